"""The rollout with a tool environment (tests/calc_tool_env.py): the tools in the first prompt,
tool results glued as tool messages, the trajectory invariant (head + reply ids + glue ids,
exactly), the trainer's log-probs equal to the sampler's with tool messages present, free
generation where a tool environment lists no actions, and broken tool environments as infra
errors. Three templates: the tiny ChatML one (the fallback: tools in the system text,
``<tool_response>`` user turns), Qwen2.5's (native ``tools=`` and ``role: tool`` messages, which
it renders as the fallback's user turn) and a variant of it whose tool messages are a ``tool``
turn (so a result glued as a user turn would show)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import calc_tool_env  # tests/ is on sys.path
from batches import mask_runs
from agentgym.chat import ChatFormatter
from agentgym.config import AlgorithmConfig, TrainerConfig
from agentgym.rollout.engines.hf import HFEngine
from agentgym.rollout.loop import EpisodeSpec, RolloutSettings, run_episodes
from agentgym.training.batch import TrainBatch
from agentgym.training.policy_trainer import PolicyTrainer
from env_adapters import make_env
from env_adapters.tool_calls import TOOL_RESULTS, ToolCall, ToolOutcome, render_results_text

QWEN25 = (Path(__file__).parent / "fixtures" / "qwen2_5_chat_template.jinja").read_text()
TEMPLATES = {"native": QWEN25,
             "native-tool-turn": QWEN25.replace("{{- '<|im_start|>user' }}", "{{- '<|im_start|>tool' }}")}


@pytest.fixture(scope="module", params=["fallback", "native", "native-tool-turn"])
def setup(request, tiny_path):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    if request.param in TEMPLATES:
        assert TEMPLATES[request.param] != tok.chat_template
        tok.chat_template = TEMPLATES[request.param]
    fmt = ChatFormatter(tok)
    assert fmt.native_tools is (request.param in TEMPLATES)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32), tok)
    return engine, fmt, tiny_path


def _specs(n: int, **kw) -> list[EpisodeSpec]:
    return [EpisodeSpec(calc_tool_env.PATH, t, 0, f"g{t}", f"e{t}", dict(kw)) for t in range(n)]


def _settings(**kw) -> RolloutSettings:
    base = dict(horizon=4, max_new_tokens=10, seed=7, constrain_actions=True)
    return RolloutSettings(**{**base, **kw})


def _replay(fmt: ChatFormatter, ep, kw) -> tuple[list[int], list[int], list[int]]:
    """The episode rebuilt from its stored replies in a fresh environment: the ids the rollout
    must have appended (head, each reply as stored, each step's glue), their mask, and the
    number of tool results of each step."""
    env = calc_tool_env.CalcToolEnv(**kw)
    obs, _ = env.reset(ep.task_id, ep.seed)
    assert ep.turns[0].observation == obs
    ids = fmt.start(env.system_prompt(), obs, tools=env.tools())
    mask = [0] * len(ids)
    n_results = []
    runs = mask_runs(ep.loss_mask)
    assert len(runs) == ep.num_turns
    for k, (a, b) in enumerate(runs):
        reply = ep.input_ids[a:b]
        text = fmt.reply_text(reply)
        assert text == ep.turns[k].action_text
        listed = env.valid_actions()
        if listed is not None:  # a constrained turn: the reply is one of the listed actions
            assert text in listed
        res = env.step(text)
        n_results.append(len(res.info.get(TOOL_RESULTS) or []))
        ids += reply
        mask += [1] * len(reply)
        if k + 1 < len(runs):
            glue = fmt.glue_step(res.observation, res.info, fmt.ends_turn(reply))
            ids += glue
            mask += [0] * len(glue)
            assert ep.turns[k + 1].observation == res.observation
    return ids, mask, n_results


def test_tool_episodes_are_the_head_the_replies_and_the_glue_exactly(setup):
    engine, fmt, _ = setup
    kw = {"listed": "alternate"}
    eps = run_episodes(engine, fmt, _specs(6, **kw), _settings(), make_env)
    counts: list[int] = []
    for ep in eps:
        assert not ep.infra_error and ep.num_turns == 4 and ep.truncated, ep.error
        ids, mask, n_results = _replay(fmt, ep, kw)
        assert ep.input_ids == ids and ep.loss_mask == mask
        counts += n_results
        # the first prompt carries the tools, whichever way the template puts them
        head = fmt.tokenizer.decode(ep.input_ids[:ep.loss_mask.index(1)])
        assert '"name": "add"' in head and '"name": "submit"' in head and "<tool_call>" in head
        for k, turn in enumerate(ep.turns):
            if k % 2 == 0:  # listed turns: a tool call, whose results are the next observation
                assert not turn.format_error and n_results[k] > 0
                assert ep.turns[k + 1].observation.startswith("<tool_response>")
    # not vacuous: steps with one result, with two, and free replies without a call
    assert {0, 1, 2} <= set(counts), counts


def test_trainer_recomputes_the_samplers_logprobs_with_tool_messages(setup):
    engine, fmt, path = setup
    kw = {"listed": "alternate"}
    eps = run_episodes(engine, fmt, _specs(4, **kw), _settings(), make_env)
    assert all(not e.infra_error for e in eps)
    tr = PolicyTrainer(path, fmt.tokenizer, TrainerConfig(learning_rate=1e-4, bf16=False), AlgorithmConfig(), seed=0)

    def recomputed(rows):
        batch = TrainBatch.from_rows(rows, 0)
        got = tr.compute(batch, ["logprobs"])["logprobs"]
        mask = batch.loss_mask.bool()
        return got[mask], batch.old_logprobs[mask]

    rows = [{"input_ids": e.input_ids, "loss_mask": e.loss_mask, "old_logprobs": e.old_logprobs,
             "advantages": [0.0] * len(e.input_ids)} for e in eps]
    got, want = recomputed(rows)
    assert got.numel() > 0
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    # control: the same replies after a first prompt without the tools are not what was sampled
    env = calc_tool_env.CalcToolEnv(**kw)
    cut = []
    for e in eps:
        obs, _ = env.reset(e.task_id, e.seed)
        head = fmt.start(env.system_prompt(), obs, tools=env.tools())
        bare = fmt.start(env.system_prompt(), obs)
        assert e.input_ids[:len(head)] == head and len(bare) < len(head)
        n = len(head)
        cut.append({"input_ids": bare + e.input_ids[n:], "loss_mask": [0] * len(bare) + e.loss_mask[n:],
                    "old_logprobs": [0.0] * len(bare) + e.old_logprobs[n:], "advantages": [0.0] * (len(bare) + len(e.input_ids) - n)})
    got, want = recomputed(cut)
    assert (got - want).abs().max() > 1e-2


def test_a_tool_env_listing_no_actions_is_generated_freely_under_constrain_actions(setup):
    """ToolEnv.valid_actions() is None by default: with constrain_actions the replies are
    generated (never chosen), and the rollout is the one without constrain_actions."""
    engine, fmt, _ = setup
    chosen = []
    real = engine.choose

    def counting(*a, **kw):
        chosen.append(len(a[0]))
        return real(*a, **kw)

    engine.choose = counting
    try:
        a = run_episodes(engine, fmt, _specs(3), _settings(constrain_actions=True), make_env)
    finally:
        del engine.choose
    b = run_episodes(engine, fmt, _specs(3), _settings(constrain_actions=False), make_env)
    assert chosen == []
    assert [e.input_ids for e in a] == [e.input_ids for e in b]
    assert [e.old_logprobs for e in a] == [e.old_logprobs for e in b]
    assert all(not e.infra_error and e.num_turns == 4 for e in a)
    assert all(t.format_error for e in a for t in e.turns)  # a random model writes no call


class _BadResults(calc_tool_env.CalcToolEnv):
    """Its step's tool results are not the contract's: a content that is not a string."""

    def step(self, action_text):
        res = super().step(action_text)
        for r in res.info.get(TOOL_RESULTS) or []:
            r["content"] = 3
        return res


class _BadTools(calc_tool_env.CalcToolEnv):
    def tools(self):
        return super().tools() * 2  # every name twice


class _Ends(calc_tool_env.CalcToolEnv):
    """Ends the episode at its first call (the tool results of the last step are not glued)."""

    def call_tool(self, call: ToolCall) -> ToolOutcome:
        return ToolOutcome("done", done=True, reward=1.0, success=True)


def test_broken_tool_envs_are_infra_errors_of_their_episode(setup):
    engine, fmt, _ = setup
    kinds = {"bad_results": _BadResults, "bad_tools": _BadTools, "ends": _Ends, "good": calc_tool_env.CalcToolEnv}

    def make(name, **kw):
        return kinds[name](**kw)

    specs = [EpisodeSpec(name, 0, 0, f"g{name}", name, {"listed": "all"}) for name in kinds]
    eps = {e.episode_id: e for e in run_episodes(engine, fmt, specs, _settings(horizon=2), make)}
    assert eps["bad_results"].infra_error and "tool results" in eps["bad_results"].error
    assert eps["bad_results"].num_turns == 0
    assert eps["bad_tools"].infra_error and "appears twice" in eps["bad_tools"].error
    assert not eps["good"].infra_error and eps["good"].num_turns == 2
    ends = eps["ends"]
    assert not ends.infra_error and ends.terminated and ends.success and ends.num_turns == 1
    assert ends.loss_mask[-1] == 1  # nothing glued after the last reply


def test_fallback_observation_is_the_tool_response_text(setup):
    """What people read (Turn.observation) is the results as <tool_response> text, whatever the
    template does with them."""
    engine, fmt, _ = setup
    eps = run_episodes(engine, fmt, _specs(2, listed="all"), _settings(horizon=2), make_env)
    for ep in eps:
        env = calc_tool_env.CalcToolEnv(listed="all")
        env.reset(ep.task_id, ep.seed)
        res = env.step(ep.turns[0].action_text)
        assert ep.turns[1].observation == render_results_text(res.info[TOOL_RESULTS]) == res.observation


def test_window_segments_keep_the_tools_in_their_head(setup):
    """context_policy window: every new segment starts with the first prompt, tools included."""
    engine, fmt, _ = setup
    eps = run_episodes(engine, fmt, _specs(2, listed="all"), _settings(context_policy="window", context_window=1),
                       make_env)
    assert all(ep.context_starts for ep in eps)
    for ep in eps:
        env = calc_tool_env.CalcToolEnv(listed="all")
        obs, _ = env.reset(ep.task_id, ep.seed)
        head = fmt.start(env.system_prompt(), obs, tools=env.tools())
        for start in [0, *ep.context_starts]:
            assert ep.input_ids[start:start + len(head)] == head
