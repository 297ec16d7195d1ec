"""Every adapter passes the conformance suite again through the AgentGym HTTP server + client,
and a server killed mid-rollout makes its episodes infra errors while the rest complete."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

from serving import ServerThread  # noqa: E402
from test_conformance import CASES, HORIZON, env_kwargs, truncate_at, unavailable  # noqa: E402

from env_adapters.checker import check_env  # noqa: E402
from env_adapters.http_client import HTTPEnv  # noqa: E402
from env_adapters.http_server import create_app  # noqa: E402


@pytest.mark.parametrize("env_name", sorted(CASES))
def test_conformance_over_http(env_name: str) -> None:
    if why := unavailable(env_name):
        pytest.skip(why)
    server = ServerThread(create_app(env_name, max_envs=16, env_kwargs=env_kwargs(env_name)))
    try:
        # a move-limit truncation (SciWorld, TextWorldExpress) must survive the protocol too
        report = check_env(lambda: HTTPEnv(server.url, env_name, dialect="agentgym", timeout_s=60),
                           CASES[env_name], horizon=HORIZON, check_resources=False,
                           truncate_at=truncate_at(env_name))
        print(f"{env_name} over HTTP: {report['ms_per_step']:.2f} ms/step, {report['ms_per_reset']:.2f} ms/reset")
        assert report["steps"] > 0
    finally:
        server.stop()


def test_a_lone_surrogate_from_any_client_is_answered_not_a_500(monkeypatch):
    """A client may send invalid UTF-8 as a JSON "\\udcff" escape; an adapter quoting the reply
    would then make the UTF-8 response fail (HTTP 500). The server replaces lone surrogates
    first, so the reply is answered like any other garbage."""
    import httpx

    import env_adapters

    monkeypatch.setitem(env_adapters.ADAPTERS, "echo", "serving:EchoEnv")
    server = ServerThread(create_app("echo", max_envs=2))
    try:
        env_id = httpx.post(f"{server.url}/create", json={}).json()["id"]
        httpx.post(f"{server.url}/reset", json={"id": env_id, "data_idx": 0})
        raw = '{"id": %d, "action": "Action: \\udcff\\ud800 fly"}' % env_id
        resp = httpx.post(f"{server.url}/step", content=raw, headers={"content-type": "application/json"})
        assert resp.status_code == 200, resp.text
        assert resp.json()["observation"] == "Not an action: Action: \ufffd\ufffd fly"
        assert resp.json()["info"]["format_error"] is True
    finally:
        server.stop()


def test_killed_server_gives_infra_error_rest_completes(tiny_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentgym.chat import ChatFormatter
    from agentgym.rollout.engines.hf import HFEngine
    from agentgym.rollout.loop import EpisodeSpec, RolloutSettings, run_episodes
    from env_adapters import make_env

    tok = AutoTokenizer.from_pretrained(tiny_path)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32), tok)
    server = ServerThread(create_app("keyword", max_envs=16, env_kwargs={"target": "zzz"}))
    remote = {"base_url": server.url, "env_name": "keyword", "dialect": "agentgym",
              "timeout_s": 2, "retries": 1, "backoff_s": 0.05}
    specs = ([EpisodeSpec("http", 0, 0, "remote", f"r{i}", remote) for i in range(3)]
             + [EpisodeSpec("keyword", 0, 0, "local", f"l{i}", {"target": "zzz"}) for i in range(3)])

    turns_seen = []

    def on_turn(turn: int, live: int) -> None:
        turns_seen.append(turn)
        if turn == 0:
            server.stop()  # the environment server dies after the first turn

    t0 = time.perf_counter()
    episodes = run_episodes(engine, ChatFormatter(tok), specs,
                            RolloutSettings(horizon=4, max_new_tokens=4), make_env, on_turn=on_turn)
    elapsed = time.perf_counter() - t0
    by_group = {g: [e for e in episodes if e.group_id == g] for g in ("remote", "local")}
    assert all(e.infra_error and math.isnan(e.reward) and "infra" in e.error for e in by_group["remote"])
    assert all(not e.infra_error and e.num_turns == 4 for e in by_group["local"])
    assert elapsed < 30
