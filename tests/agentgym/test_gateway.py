"""The OpenAI-compatible gateway (agentgym/gateway) on a real server on 127.0.0.1 with the tiny
model, driven by the ``openai`` client:

* a conversation through the gateway is the rollout loop's, token for token (ids, loss mask,
  log-probs), tool calls and tool results included, with the fallback and a native template;
* an edited history starts a new context segment (rendered fresh), counted in
  ``context_starts``, while extended histories glue onto the sampled ids;
* an agent written with ``openai`` (examples/openai_agent.py) trains through the ``agent``
  environment kind: its episodes are in the store and the parameters changed;
* agents that fail are infra errors of their episodes; bad requests get clear 4xx errors and
  the server stays up.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml
from openai import BadRequestError, NotFoundError, OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

import calc_tool_env  # tests/ is on sys.path
import gateway_agents
from agentgym.batch import EpisodeBatch
from agentgym.chat import ChatFormatter
from agentgym.gateway.agents import play_agents, run_played
from agentgym.gateway.messages import parse_messages, render_messages
from agentgym.gateway.recorder import Gateway, GatewaySettings
from agentgym.gateway.server import GatewayServer
from agentgym.pipeline import IterationRef, PolicySession
from agentgym.rollout.engines.hf import HFEngine
from agentgym.rollout.loop import EpisodeSpec, RolloutSettings, run_episodes
from agentgym.store.trajectory_store import TrajectoryStore
from agentgym.types import Episode
from configs import parse_tiny_config, tiny_config
from env_adapters import make_env

QWEN25 = (Path(__file__).parent / "fixtures" / "qwen2_5_chat_template.jinja").read_text()
# Qwen2.5's template renders tool results as a user turn, as the fallback does; this variant makes
# them a ``tool`` turn, so results glued as a user message would show (test_rollout_tools.py too)
TEMPLATES = {"native": QWEN25,
             "native-tool-turn": QWEN25.replace("{{- '<|im_start|>user' }}", "{{- '<|im_start|>tool' }}")}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tiny_path):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32), tok)
    return engine, tok


class ForcedTurns:
    """An engine that, at the listed turns of each conversation (its cache key), samples the
    given reply (``choose`` among one candidate: the policy's own log-probs of it) and
    otherwise generates; one prompt per engine call, so both paths batch alike. A random tiny
    model writes no tool call by itself; this makes the conversations hold some."""

    def __init__(self, engine: HFEngine, fmt: ChatFormatter, forced: dict[int, str]):
        self.engine = engine
        self.forced = {k: fmt.action_reply_ids(text, []) for k, text in forced.items()}
        self.turns: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def generate(self, prompts, params, cache_keys=None):
        out = []
        for i, (prompt, key) in enumerate(zip(prompts, cache_keys)):
            turn = self.turns[key] = self.turns.get(key, -1) + 1
            one = replace(params, row_seeds=None if params.row_seeds is None else [params.row_seeds[i]])
            if turn in self.forced:
                out += self.engine.choose([prompt], [[self.forced[turn]]], one, cache_keys=[key])
            else:
                out += self.engine.generate([prompt], one, cache_keys=[key])
        return out


def _forced(t: int) -> dict[int, str]:
    return {0: f"I will add.\n{calc_tool_env.call_text('add', a=t + 1, b=t + 2)}",
            2: f"Two sums.\n{calc_tool_env.call_text('add', a=t, b=1)}\n{calc_tool_env.call_text('add', a=2, b=t)}"}


@pytest.mark.parametrize("template", ["fallback", "native", "native-tool-turn"])
def test_a_conversation_through_the_gateway_is_the_rollouts_token_for_token(tiny, template):
    engine, tok = tiny
    tok = AutoTokenizer.from_pretrained(tok.name_or_path)
    if template in TEMPLATES:
        tok.chat_template = TEMPLATES[template]
    fmt = ChatFormatter(tok)
    assert fmt.native_tools is (template in TEMPLATES)
    settings = RolloutSettings(horizon=4, max_new_tokens=10, seed=7, seeds_per_episode=True)
    tasks = [0, 1]
    # the rollout loop with the environment in process
    loop = run_episodes(ForcedTurns(engine, fmt, _forced(0)), fmt,
                        [EpisodeSpec(calc_tool_env.PATH, t, 3, f"g{t}", f"e{t}") for t in tasks], settings, make_env)
    # the same episodes played by an openai-client agent through the gateway (agent kind)
    kwargs = {"entrypoint": "gateway_agents:mirror_calc", "tasks": [{"horizon": 4, "max_tokens": 10}] * 2}
    specs = [EpisodeSpec("agent", t, 3, f"g{t}", f"e{t}", kwargs) for t in tasks]
    played = sorted(play_agents(ForcedTurns(engine, fmt, _forced(0)), fmt, specs, settings), key=lambda x: x[0])
    via = [ep for _, ep in played]
    for a, b in zip(loop, via):
        assert not a.infra_error and not b.infra_error, (a.error, b.error)
        assert b.env == "agent" and b.num_turns == a.num_turns == 4
        assert b.input_ids == a.input_ids
        assert b.loss_mask == a.loss_mask
        torch.testing.assert_close(torch.tensor(b.old_logprobs), torch.tensor(a.old_logprobs), atol=1e-5, rtol=0)
        assert [t.action_text for t in b.turns] == [t.action_text for t in a.turns]
        assert [t.observation for t in b.turns] == [t.observation for t in a.turns]
        assert b.context_starts == a.context_starts == []
        # not vacuous: tool results glued after the forced calls (one, then two), a user turn after a free reply
        assert b.turns[1].observation.count("<tool_response>") == 1
        assert b.turns[3].observation.count("<tool_response>") == 2
        assert not b.turns[2].observation.startswith("<tool_response>")
        assert b.turns[0].parsed_action and b.turns[2].parsed_action.count("add(") == 2


def _chat(c: OpenAI, messages: list[Any], **kw: Any) -> Any:
    return c.chat.completions.create(model="policy", messages=messages, max_tokens=6, **kw)


def test_an_edited_history_starts_a_new_counted_segment(tiny):
    engine, tok = tiny
    fmt = ChatFormatter(tok)
    ended: list[Episode] = []
    gw = Gateway(engine, fmt, GatewaySettings(horizon=8, max_new_tokens=6, seed=1), open_episodes=True,
                 on_end=ended.append)
    try:
        with GatewayServer(gw) as srv:
            c = OpenAI(base_url=srv.episode_url("edit-e0"), api_key="x", max_retries=0)
            msgs: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "one"}]
            r1 = _chat(c, msgs)
            msgs += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "two"}]
            r2 = _chat(c, msgs)
            assert r2.usage.prompt_tokens > r1.usage.prompt_tokens + r1.usage.completion_tokens
            # the agent rewrites its history: the first reply replaced by its own text
            edited = [msgs[0], msgs[1], {"role": "assistant", "content": "an answer I prefer"},
                      {"role": "user", "content": "three"}]
            r3 = _chat(c, edited)
            edited += [r3.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "four"}]
            _chat(c, edited)  # extends the edited history: the same segment
            dropped = [msgs[0], {"role": "user", "content": "five"}]  # a truncated history
            _chat(c, dropped)
            httpx.post(f"{srv.url}/episodes/edit-e0/reward", json={"reward": 0.5}).raise_for_status()
            summary = httpx.post(f"{srv.url}/episodes/edit-e0/end").json()
    finally:
        gw.close()
    (ep,) = ended
    assert summary["context_segments"] == 3 and gw.segments_started == 2
    assert len(ep.context_starts) == 2 and ep.num_turns == 5 and not ep.infra_error and ep.reward == 0.5
    s1, s2 = ep.context_starts
    # segment 1: the first prompt, reply 1 as sampled, the glue of "two", reply 2
    reply = [k for k, m in enumerate(ep.loss_mask) if m]
    head = fmt.start("Be brief.", "one")
    n1 = r1.usage.completion_tokens
    r1_ids = ep.input_ids[len(head):len(head) + n1]
    glue = fmt.glue("two", fmt.ends_turn(r1_ids))
    assert ep.input_ids[:len(head)] == head and all(ep.loss_mask[len(head):len(head) + n1])
    assert ep.input_ids[len(head) + n1:len(head) + n1 + len(glue)] == glue
    assert s1 == len(head) + n1 + len(glue) + r2.usage.completion_tokens
    # segment 2 starts with the edited history rendered fresh (its prompt), all context
    fresh = render_messages(fmt, parse_messages(edited[:4]), None)
    assert ep.input_ids[s1:s1 + len(fresh)] == fresh and not any(ep.loss_mask[s1:s1 + len(fresh)])
    assert ep.input_ids[:len(fresh)] != fresh  # not what segment 1 held: another prompt
    # segment 3: the system prompt and "five", as a first prompt
    five = fmt.start("Be brief.", "five")
    assert ep.input_ids[s2:s2 + len(five)] == five
    assert reply[-1] == len(ep.input_ids) - 1
    # the trainer sees one row per segment, each a prompt the policy saw and its replies
    rows, _ = EpisodeBatch.from_episodes([ep]).segments()
    assert len(rows) == 3
    assert rows["input_ids"][2][:len(five)] == five


def test_fresh_rendering_of_a_history_matches_the_incremental_text(tiny):
    """A new segment's rendering of a history (tool calls and results, fallback template) is
    the text the incremental ids decode to, when the replies are what the template writes."""
    _, tok = tiny
    fmt = ChatFormatter(tok)
    env = calc_tool_env.CalcToolEnv()
    obs, _ = env.reset(2, 0)
    reply = calc_tool_env.call_text("add", a=3, b=4)
    res = env.step(reply)
    ids = fmt.start(env.system_prompt(), obs, tools=env.tools()) + fmt.action_reply_ids(reply, []) \
        + fmt.glue_step(res.observation, res.info, True)
    msgs = parse_messages([
        {"role": "system", "content": env.system_prompt()}, {"role": "user", "content": obs},
        {"role": "assistant", "content": None, "tool_calls": res.info["tool_calls"]},
        {"role": "tool", "tool_call_id": "call_0_0", "content": "7"}])
    fresh = render_messages(fmt, msgs, env.tools())
    assert tok.decode(fresh) == tok.decode(ids)
    bad = render_messages(fmt, msgs[:3] + parse_messages([{"role": "tool", "tool_call_id": "call_0_0",
                                                            "content": "8"}]), env.tools())
    assert tok.decode(bad) != tok.decode(ids)


AGENT_TASKS = [{"kind": "keyword", "letters": "aeiou", "max_tokens": 6},
               {"kind": "calculator", "question": "What is 3 + 4?", "answer": 7, "max_turns": 2, "max_tokens": 6}]


def test_an_openai_agent_trains_through_the_gateway(tmp_path, model_cache, monkeypatch):
    """examples/openai_agent.py (the openai package, nothing of agentgym) as the agent env kind:
    one collect -> advantages -> update; the episodes are in the store, scored, with the
    sampler's log-probs (the trainer recomputes them), and the weights changed."""
    monkeypatch.chdir(ROOT)  # the entrypoint's module is found from the working directory
    cfg = parse_tiny_config(model_cache, store_root=tmp_path / "store", seed=2, envs=[
        {"name": "agent", "tasks": [0, 1],
         "kwargs": {"entrypoint": "examples.openai_agent:run", "tasks": AGENT_TASKS}}],
        rollout={"group_size": 3}, schedule={"stages": [{"horizon": 3, "iterations": 1}]})
    session = PolicySession(cfg, "gateway-train")
    try:
        before = {k: v.clone() for k, v in session.engine.model.state_dict().items()}
        ref = IterationRef(0, 0, 0)
        rollout = session.collect(ref, horizon=3)
        assert rollout["episodes"] == 6 and rollout["infra_error_episodes"] == 0
        eps = session.store.read_episodes(0, 0)
        assert len(eps) == 6 and {e.env for e in eps} == {"agent"}
        for e in eps:
            assert not e.infra_error and 0.0 <= e.reward <= 1.0 and sum(e.loss_mask) > 0, e.error
            assert all(lp != 0.0 for lp, m in zip(e.old_logprobs, e.loss_mask) if m)
            head = session.tokenizer.decode(e.input_ids[:e.loss_mask.index(1)])
            assert ('"name": "submit"' in head) == (e.task_id == 1)  # the calculator's tools in its prompt
        keyword = [e.reward for e in eps if e.task_id == 0]
        assert len(set(keyword)) > 1, keyword  # the group has a signal (else nothing would train)
        batch = EpisodeBatch.from_episodes(eps)
        padded = batch.padded(0)
        got = session.trainer.compute(padded, ["logprobs"])["logprobs"]
        mask = padded.loss_mask.bool()
        torch.testing.assert_close(got[mask], padded.old_logprobs[mask], atol=2e-4, rtol=0)
        adv = session.advantages(ref)
        assert adv["rows"] == 6
        upd = session.update(ref)
        assert upd["updated"] and upd["train_episodes"] >= 3
        after = session.engine.model.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)
    finally:
        session.close()


def test_failing_agents_are_infra_errors_of_their_episodes(tiny):
    engine, tok = tiny
    fmt = ChatFormatter(tok)
    settings = RolloutSettings(horizon=2, max_new_tokens=4, seed=0)
    names = ["raises", "garbage", "posts_reward", "silent", "hangs"]
    specs = [EpisodeSpec("agent", 0, 0, f"g{k}", f"g{k}-e0",
                         {"entrypoint": f"gateway_agents:{n}", "timeout_s": 3.0}) for k, n in enumerate(names)]
    specs.append(EpisodeSpec(calc_tool_env.PATH, 0, 0, "calc", "calc-e0"))  # the loop plays this one
    gateway_agents.HANG.clear()
    try:
        eps = {e.episode_id: e for e in run_played(engine, fmt, specs, settings, make_env)}
    finally:
        gateway_agents.HANG.set()
    assert list(eps) == [s.episode_id for s in specs]
    err = {n: eps[f"g{k}-e0"].error or "" for k, n in enumerate(names)}
    assert "RuntimeError: the agent's own bug" in err["raises"]
    assert "'not a reward'" in err["garbage"]
    assert "no model call" in err["silent"]
    assert "timeout_s=3" in err["hangs"]
    ok = eps["g2-e0"]
    assert not ok.infra_error and ok.reward == 0.25 and ok.num_turns == 1 and ok.turns[-1].reward == 0.25
    for n in ("raises", "garbage", "silent", "hangs"):
        e = eps[f"g{names.index(n)}-e0"]
        assert e.infra_error and e.reward != e.reward  # NaN: unscored
    assert not eps["calc-e0"].infra_error and eps["calc-e0"].env == calc_tool_env.PATH
    with pytest.raises(ValueError, match="package.module:function"):
        list(play_agents(engine, fmt, [EpisodeSpec("agent", 0, 0, "g", "g-e0", {"entrypoint": "nocolon"})], settings))
    with pytest.raises(ValueError, match="not in the 1 listed tasks"):
        list(play_agents(engine, fmt, [EpisodeSpec("agent", 3, 0, "g", "g-e0", {
            "entrypoint": "gateway_agents:silent", "tasks": [{}]})], settings))


def _post(url: str, body: Any = None, raw: bytes | None = None) -> httpx.Response:
    if raw is not None:
        return httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=30)
    return httpx.post(url, json=body, timeout=30)


def test_bad_requests_get_clear_errors_and_the_server_stays_up(tiny):
    engine, tok = tiny
    fmt = ChatFormatter(tok)
    gw = Gateway(engine, fmt, GatewaySettings(horizon=2, max_new_tokens=4, max_context_tokens=200))
    gw.register("ok-e0")
    gw.register("long-e0")
    user = [{"role": "user", "content": "hi"}]
    try:
        with GatewayServer(gw) as srv:
            chat = f"{srv.url}/episodes/ok-e0/v1/chat/completions"

            def refused(r: httpx.Response, status: int, code: str | None = None, says: str = "") -> None:
                assert r.status_code == status, r.text
                err = r.json()["error"]
                assert isinstance(err["message"], str) and says in err["message"], err
                if code is not None:
                    assert err["code"] == code, err

            refused(_post(f"{srv.url}/episodes/nobody/v1/chat/completions", {"messages": user}), 404,
                    "unknown_episode", "unknown episode 'nobody'")
            refused(_post(chat, {"messages": user, "stream": True}), 400, "unsupported_parameter", "stream=true")
            refused(_post(chat, {"messages": user, "n": 2}), 400, "unsupported_parameter")
            refused(_post(chat, raw=b"{not json"), 400, says="not valid JSON")
            refused(_post(chat, raw=b"[1, 2]"), 400, says="JSON object")
            for bad, says in [
                ({}, "non-empty list"), ({"messages": "hi"}, "non-empty list"),
                ({"messages": [{"content": "hi"}]}, "role must be one of"),
                ({"messages": [{"role": "user", "content": 3}]}, "content must be a string"),
                ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text part"),
                ({"messages": user + [{"role": "assistant", "content": "x"}]}, "last message"),
                ({"messages": user + [{"role": "system", "content": "x"}, *user]}, "only be the first"),
                ({"messages": user + [{"role": "tool", "content": "7"}]}, "tool_call_id"),
                ({"messages": user + [{"role": "assistant", "tool_calls": [{"function": {}}]}, *user]}, "tool_calls[0]"),
                ({"messages": user, "tools": [{"type": "function"}]}, "tools:"),
                ({"messages": user, "max_tokens": 0}, "max_tokens"),
                ({"messages": user, "temperature": "hot"}, "temperature"),
                ({"messages": user, "seed": 1.5}, "seed"),
            ]:
                refused(_post(chat, bad), 400, says=says)
            refused(_post(f"{srv.url}/episodes/ok-e0/reward", {"reward": "lots"}), 400, says="finite number")
            refused(_post(f"{srv.url}/episodes/ok-e0/reward", {"score": 1}), 400, says='"reward"')
            refused(_post(f"{srv.url}/episodes/long-e0/v1/chat/completions",
                          {"messages": [{"role": "user", "content": "word " * 400}]}), 400,
                    "context_length_exceeded", "context limit of 200")
            refused(_post(chat, raw=b'{"messages": "' + b"x" * (33 << 20) + b'"}'), 413)
            refused(httpx.get(f"{srv.url}/v1/chat/completions"), 404, says="/episodes/{episode_id}/v1")
            # the openai client raises them as its own errors
            c = OpenAI(base_url=srv.episode_url("ok-e0"), api_key="x", max_retries=0)
            with pytest.raises(BadRequestError, match="stream=true is not supported"):
                c.chat.completions.create(model="policy", messages=user, stream=True)
            # none of it hurt the server or the episode: it still answers, up to its horizon
            assert httpx.get(f"{srv.url}/health").json()["status"] == "ok"
            assert [m.id for m in c.models.list()] == ["policy"]
            for _ in range(2):
                assert _chat(c, user).choices[0].message.role == "assistant"
            refused(_post(chat, {"messages": user}), 400, "horizon_reached", "horizon of 2 replies")
            assert httpx.post(f"{srv.url}/episodes/ok-e0/end").json()["ended"] is True
            refused(_post(chat, {"messages": user}), 404, "episode_ended", "has ended")
            refused(_post(f"{srv.url}/episodes/ok-e0/end"), 404, "episode_ended")
            refused(_post(f"{srv.url}/episodes/ok-e0/reward", {"reward": 1}), 404, "episode_ended")
            with pytest.raises(NotFoundError):
                c.models.list()
            assert srv.thread.is_alive()
            ep = gw.finish("ok-e0", reward=1.0)
            assert ep.truncated and ep.num_turns == 2 and ep.reward == 1.0
            assert gw.finish("long-e0").infra_error  # refused before any reply: nothing to train on
    finally:
        gw.close()
    assert json.loads(json.dumps(ep.turns[0].observation)) == "hi"


def test_the_example_agent_runs_the_models_tool_calls(tiny, monkeypatch):
    """examples/openai_agent.py's calculator: the model's call (forced here: a random model
    writes none) comes back as an OpenAI tool call, the agent answers it with a tool message
    (glued as the template's tool result), and the submitted answer is the reward."""
    monkeypatch.chdir(ROOT)
    engine, tok = tiny
    fmt = ChatFormatter(tok)
    forced = ForcedTurns(engine, fmt, {0: calc_tool_env.call_text("add", a=3, b=4),
                                       1: f"Done.\n{calc_tool_env.call_text('submit', answer=7)}"})
    task = {"kind": "calculator", "question": "What is 3 + 4?", "answer": 7, "max_tokens": 4}
    spec = EpisodeSpec("agent", 0, 0, "g", "g-e0", {"entrypoint": "examples.openai_agent:run", "tasks": [task]})
    ((_, ep),) = list(play_agents(forced, fmt, [spec], RolloutSettings(horizon=3, max_new_tokens=4, seed=0)))
    assert not ep.infra_error and ep.reward == 1.0 and ep.success and ep.num_turns == 2, ep.error
    assert ep.turns[0].parsed_action == 'add({"a": 3, "b": 4})'
    assert ep.turns[1].observation == "<tool_response>\n7\n</tool_response>"
    assert ep.turns[1].parsed_action == 'submit({"answer": 7})'
    assert fmt.tokenizer.decode(ep.input_ids).count('"name": "multiply"') == 1  # the tools, once, in the prompt


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_gateway_serve_command_stores_ended_episodes(tmp_path, model_cache, sig):
    """`agentgym gateway serve -c CONFIG --port P` as a real process: an openai client plays
    episodes; every 2 ended ones are committed as an iteration of the run, and the one left is
    committed when the server is stopped (Ctrl+C or SIGTERM), which exits 0."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(model_cache, store_root=tmp_path / "store")))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "agentgym_cli.cli", "gateway", "serve", "-c", str(cfg), "--port", str(port),
           "--run-id", "served", "--commit-every", "2", "--log-level", "warning"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"the server exited early:\n{log_path.read_text()}"
            try:
                assert httpx.get(f"{url}/health", timeout=2).json()["status"] == "ok"
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, f"no /health:\n{log_path.read_text()}"
                time.sleep(0.2)
        for k in range(3):
            c = OpenAI(base_url=f"{url}/episodes/cli-e{k}/v1", api_key="x", max_retries=0)
            _chat(c, [{"role": "user", "content": f"hello {k}"}])
            httpx.post(f"{url}/episodes/cli-e{k}/reward", json={"reward": k / 2}).raise_for_status()
            done = httpx.post(f"{url}/episodes/cli-e{k}/end").json()
            assert done["reward"] == k / 2 and done["turns"] == 1
        store = TrajectoryStore(str(tmp_path / "store"), "served")
        assert [e.episode_id for e in store.read_episodes(0, 0)] == ["cli-e0", "cli-e1"]
        assert not store.is_committed("episodes", 0, 1)  # one episode waits for the next commit
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (last,) = store.read_episodes(0, 1)
    assert last.episode_id == "cli-e2" and last.reward == 1.0 and last.env == "agent" and sum(last.loss_mask) > 0
    assert "committed 1 episodes as stage 0 iteration 1 of run served" in log_path.read_text()
