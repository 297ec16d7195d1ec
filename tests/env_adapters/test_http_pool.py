"""Environment server pools (``http`` env with ``base_urls``): spread, dead server skipped,
its in-flight episodes infra errors, back in rotation once healthy. Real uvicorn servers on
loopback (tests/env_adapters/serving.py)."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
from transformers import AutoTokenizer

import env_adapters
from agentgym.chat import ChatFormatter
from agentgym.config import ConfigError, parse_config
from agentgym.pipeline import plan_episodes
from agentgym.rollout.engines.base import Sample
from agentgym.rollout.loop import RolloutSettings, run_episodes
from env_adapters.base import InfraError, StepResult, TextEnv
from env_adapters.http_pool import ServerPool, pool_for
from env_adapters.http_server import create_app
from serving import ServerThread
from scripted_engine import NoCacheEngine  # tests/ is on sys.path

# 180 s: the session fixture tiny_path (a tokenizer trained here) may be built inside this
# module's first test, which then takes far longer than the tests themselves
pytestmark = pytest.mark.timeout(180)


class StepsEnv(TextEnv):
    """Any reply is one step; the episode succeeds after ``2 + task_id % 3`` steps."""

    name = "steps"

    def reset(self, task_id: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
        self.left = 2 + task_id % 3
        return f"{self.left} steps to go", {}

    def step(self, action_text: str) -> StepResult:
        self.left -= 1
        return StepResult(f"{self.left} steps to go", 1.0 if self.left == 0 else 0.0, self.left == 0, False,
                          {"format_error": False})


@pytest.fixture
def servers(monkeypatch):
    monkeypatch.setitem(env_adapters.ADAPTERS, "steps", f"{__name__}:StepsEnv")
    started: list[ServerThread] = []

    def start(port: int = 0) -> ServerThread:
        started.append(ServerThread(create_app("steps"), port=port))
        return started[-1]

    yield start
    for st in started:
        if st.thread.is_alive():
            st.stop()


def test_pool_spreads_skips_a_dead_server_and_readmits_it(servers):
    a, b = servers(), servers()
    pool = ServerPool([a.url, b.url], health_interval_s=0.2)
    got = [pool.acquire() for _ in range(4)]
    assert sorted(got) == sorted([a.url, b.url] * 2)  # least loaded: 2 each
    for url in got:
        pool.release(url)
    b.stop()
    time.sleep(0.25)  # the next acquire re-checks both
    assert {pool.acquire() for _ in range(3)} == {a.url}
    state = {s["url"]: s for s in pool.snapshot()}
    assert not state[b.url]["alive"] and "health check failed" in state[b.url]["reason"]
    assert state[a.url]["open"] == 3
    b2 = servers(port=b.port)  # the same server back where it was
    time.sleep(0.25)
    assert pool.acquire() == b2.url  # healthy again, and the least loaded
    a.stop()
    b2.stop()
    time.sleep(0.25)
    with pytest.raises(InfraError, match="no live environment server") as err:
        pool.acquire()
    assert a.url in str(err.value) and b.url in str(err.value)


class ScriptedEngine(NoCacheEngine):
    """Replies 'go' to every prompt (the env counts steps, not words)."""

    def __init__(self, tokenizer):
        self.ids = tokenizer("go", add_special_tokens=False)["input_ids"] + [
            tokenizer.convert_tokens_to_ids("<|im_end|>")]
        self.generated_tokens = 0

    def generate(self, prompts, params, cache_keys=None):
        return [Sample(list(self.ids), [-0.1] * len(self.ids), "stop") for _ in prompts]


def test_a_config_with_two_servers_survives_one_killed_mid_rollout(servers, tiny_path):
    a, b = servers(), servers()
    remote = {"base_urls": [a.url, b.url], "env_name": "steps", "retries": 1, "backoff_s": 0.05,
              "timeout_s": 5, "health_interval_s": 60}
    with pytest.raises(ConfigError, match="base_urls lists a server twice"):
        parse_config({"envs": [{"name": "http", "tasks": [0], "kwargs": {**remote, "base_urls": [a.url, a.url]}}]})
    with pytest.raises(ConfigError, match="base_url .*or kwargs.base_urls"):
        parse_config({"envs": [{"name": "http", "tasks": [0], "kwargs": {"env_name": "steps"}}]})
    cfg = parse_config({
        "envs": [{"name": "http", "tasks": list(range(6)), "kwargs": remote}],
        "rollout": {"tasks_per_iteration": 6, "group_size": 2, "max_live_episodes": 6},
        "schedule": {"stages": [{"horizon": 6, "iterations": 1}]},
    })
    specs = plan_episodes(cfg, 0)
    assert len(specs) == 12
    killed: list[int] = []

    def on_turn(call: int, n: int) -> None:
        if call == 0:  # after the 6 live episodes' first step, server b goes away
            killed.append(n)
            b.stop()

    tok = AutoTokenizer.from_pretrained(tiny_path)
    settings = RolloutSettings.from_config(cfg, horizon=6, seed=0)
    eps = run_episodes(ScriptedEngine(tok), ChatFormatter(tok), specs, settings, env_adapters.make_env,
                       on_turn=on_turn)
    assert killed == [6] and len(eps) == 12
    pool = pool_for(remote["base_urls"], remote["health_interval_s"])
    state = {s["url"]: s for s in pool.snapshot()}
    # least loaded: 3 of the first 6 on each server; the 6 started after the kill all on a
    assert (state[a.url]["episodes"], state[b.url]["episodes"]) == (9, 3)
    assert not state[b.url]["alive"] and state[b.url]["failures"] >= 1
    assert state[a.url]["alive"] and state[a.url]["open"] == state[b.url]["open"] == 0  # all released
    bad = [e for e in eps if e.infra_error]
    good = [e for e in eps if not e.infra_error]
    # b's 3 in-flight episodes: infra errors after their one step, unscored, naming the server
    assert len(bad) == 3 and all(math.isnan(e.reward) and b.url in e.error and e.num_turns == 1 for e in bad)
    # the other 9 finished: every task succeeds after 2-4 steps
    assert len(good) == 9
    assert all(e.success and e.reward == 1.0 and e.num_turns == 2 + e.task_id % 3 for e in good)
