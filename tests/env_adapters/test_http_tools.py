"""Tools over the AgentGym HTTP protocol: the server sends a tool environment's schemas with
``/reset`` (and ``GET /tools``), a step's ``info`` carries ``tool_results`` / ``tool_calls``, and
``HTTPEnv.tools()`` returns them, so a rollout through a real server on 127.0.0.1 is the
in-process one, token for token."""

from __future__ import annotations

import httpx
import pytest

import calc_tool_env  # tests/ is on sys.path
import env_adapters
from calc_tool_env import CalcToolEnv, call_text
from env_adapters.base import InfraError
from env_adapters.checker import check_env
from env_adapters.http_client import HTTPEnv
from env_adapters.http_server import create_app
from env_adapters.tool_calls import TOOL_CALLS, TOOL_RESULTS
from serving import ServerThread

pytestmark = pytest.mark.timeout(120)


class _BadTools(CalcToolEnv):
    def tools(self):
        return [{"type": "function", "function": {"name": "add"}}] * 2


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setitem(env_adapters.ADAPTERS, "calc_tools", calc_tool_env.PATH)
    monkeypatch.setitem(env_adapters.ADAPTERS, "bad_tools", f"{__name__}:_BadTools")
    started: list[ServerThread] = []

    def start(name: str, **kw) -> ServerThread:
        st = ServerThread(create_app(name, **kw))
        started.append(st)
        return st

    yield start
    for st in started:
        st.stop()


def _client(url: str, name: str = "calc_tools") -> HTTPEnv:
    return HTTPEnv(url, name, timeout_s=10, retries=1, backoff_s=0.05)


def test_tools_and_tool_results_travel_over_http(server):
    srv = server("calc_tools")
    local, remote = CalcToolEnv(), _client(srv.url)
    try:
        assert remote.tools() is None  # no episode yet
        lo, _ = local.reset(1)
        ro, _ = remote.reset(1)
        assert ro == lo and remote.tools() == local.tools()
        for reply in (f"Sum.\n{call_text('add', a=2, b=3)}{call_text('recall')}", "no call",
                      "<tool_call>{broken</tool_call>", call_text("nope"), call_text("submit", answer=5)):
            ls, rs = local.step(reply), remote.step(reply)
            assert (rs.observation, rs.reward, rs.terminated) == (ls.observation, ls.reward, ls.terminated)
            for key in (TOOL_RESULTS, TOOL_CALLS, "format_error", "invalid_action"):
                assert rs.info.get(key) == ls.info.get(key), key
        assert rs.terminated and rs.info[TOOL_RESULTS] == [{"tool_call_id": "call_4_0", "name": "submit",
                                                           "content": "correct"}]
    finally:
        remote.close()


def test_the_reset_answer_and_get_tools(server):
    srv = server("calc_tools")
    env_id = httpx.post(f"{srv.url}/create", json={}).json()["id"]
    assert httpx.get(f"{srv.url}/tools", params={"id": env_id}).json() is None  # before a reset
    reset = httpx.post(f"{srv.url}/reset", json={"id": env_id, "data_idx": 0}).json()
    assert reset["tools"] == CalcToolEnv().tools()
    assert httpx.get(f"{srv.url}/tools", params={"id": env_id}).json() == reset["tools"]
    step = httpx.post(f"{srv.url}/step", json={"id": env_id, "action": call_text("recall")}).json()
    assert step["info"][TOOL_RESULTS] == [{"tool_call_id": "call_0_0", "name": "recall", "content": "memory: 0"}]
    httpx.post(f"{srv.url}/close", json={"id": env_id})


def test_an_environment_of_text_commands_sends_no_tools(server):
    srv = server("keyword")
    env_id = httpx.post(f"{srv.url}/create", json={}).json()["id"]
    reset = httpx.post(f"{srv.url}/reset", json={"id": env_id, "data_idx": 0}).json()
    assert "tools" not in reset and "error" not in reset
    assert httpx.get(f"{srv.url}/tools", params={"id": env_id}).json() is None
    remote = _client(srv.url, "keyword")
    try:
        remote.reset(0)
        assert remote.tools() is None
    finally:
        remote.close()


def test_malformed_tools_are_an_infra_error_not_a_prompt(server):
    srv = server("bad_tools")
    remote = _client(srv.url, "bad_tools")
    try:
        with pytest.raises(InfraError, match="appears twice"):
            remote.reset(0)
    finally:
        remote.close()


def test_conformance_of_a_tool_env_over_http(server):
    srv = server("calc_tools")
    report = check_env(lambda: _client(srv.url), [0, 3], horizon=4, check_resources=False)
    assert report["steps"] > 0


def test_a_rollout_over_http_is_the_in_process_one(server, tiny_path):
    """The same tool episodes (tools in the prompt, results glued as tool messages) played
    through the server and in process: identical ids and log-probs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentgym.chat import ChatFormatter
    from agentgym.rollout.engines.hf import HFEngine
    from agentgym.rollout.loop import EpisodeSpec, RolloutSettings, run_episodes

    srv = server("calc_tools", env_kwargs={"listed": "all"})
    tok = AutoTokenizer.from_pretrained(tiny_path)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32), tok)
    fmt = ChatFormatter(tok)
    settings = RolloutSettings(horizon=3, max_new_tokens=8, seed=3, constrain_actions=True)
    specs = [EpisodeSpec("calc_tools", t, 0, f"g{t}", f"e{t}") for t in range(3)]
    local = run_episodes(engine, fmt, specs, settings, lambda name: CalcToolEnv(listed="all"))
    remote = run_episodes(engine, fmt, specs, settings, lambda name: _client(srv.url))
    assert all(not e.infra_error for e in local + remote)
    assert [e.input_ids for e in remote] == [e.input_ids for e in local]
    assert [e.old_logprobs for e in remote] == [e.old_logprobs for e in local]
    assert [[t.observation for t in e.turns] for e in remote] == [[t.observation for t in e.turns] for e in local]
    assert any("<tool_response>" in t.observation for e in local for t in e.turns)
