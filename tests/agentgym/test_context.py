"""Context policies (agentgym.context): segments are exactly what the policy saw, the trainer
recomputes the sampler's log-probs on them, and the rollout keeps token-in/token-out."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentgym.chat import ChatFormatter
from agentgym.config import AlgorithmConfig, PipelineConfig, TrainerConfig
from agentgym.context import merge_segments, segment_bounds, split_rows
from agentgym.rollout.engines.hf import HFEngine
from agentgym.rollout.loop import EpisodeSpec, RolloutSettings, run_episodes
from agentgym.training.batch import TrainBatch
from agentgym.training.policy_trainer import PolicyTrainer
from agentgym.types import Episode
from agentgym.batch import EpisodeBatch
from batches import mask_runs  # tests/ is on sys.path
from configs import DEFAULT, parse_tiny_config
from env_adapters import make_env

SYSTEM = "Reach the goal."


# -- pure functions ------------------------------------------------------------------------------
def test_split_and_merge_closed_form():
    row = {"episode_id": "e", "input_ids": list(range(10)), "loss_mask": [0, 0, 1, 1, 0, 0, 0, 0, 1, 0],
           "old_logprobs": [0, 0, -1, -2, 0, 0, 0, 0, -3, 0], "advantages": [0.5] * 10,
           "returns": None, "context_starts": [4, 7]}
    plain = {**row, "episode_id": "p", "context_starts": []}
    segs, spans = split_rows([row, plain])
    # segment [4, 7) has no sampled token: nothing to train, left out
    assert spans == [(0, 0, 4), (0, 7, 10), (1, 0, 10)]
    assert segs[0]["input_ids"] == [0, 1, 2, 3] and segs[1]["input_ids"] == [7, 8, 9]
    assert segs[1]["loss_mask"] == [0, 1, 0] and segs[1]["old_logprobs"] == [0, -3, 0]
    assert segs[1]["returns"] is None and "context_starts" not in segs[1]
    assert segs[2]["input_ids"] == list(range(10)) and segs[0]["episode_id"] == "e"
    vals = torch.arange(30, dtype=torch.float32).reshape(3, 10)
    merged = merge_segments(vals, spans, (2, 10))
    assert merged[0].tolist() == [0, 1, 2, 3, 0, 0, 0, 10, 11, 12]
    assert merged[1].tolist() == list(range(20, 30))


@pytest.mark.parametrize("starts", [[0], [3, 3], [5, 2], [10]])
def test_bad_context_starts_are_refused(starts):
    with pytest.raises(ValueError, match="increase strictly"):
        segment_bounds(10, starts)
    ep = Episode("e", "g", "babyai", 0, 0, 3, input_ids=list(range(10)), loss_mask=[0] * 10,
                 old_logprobs=[0.0] * 10, context_starts=starts)
    with pytest.raises(ValueError, match="context_starts"):
        ep.validate()


def test_config_fields():
    cfg = PipelineConfig(rollout={"context_policy": "window", "context_window": 2})
    assert cfg.rollout.context_policy.value == "window"
    with pytest.raises(ValueError, match="context_policy"):
        PipelineConfig(rollout={"context_policy": "sliding"})


# -- the rollout ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(tiny_path):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32), tok)
    return engine, ChatFormatter(tok, response_prefix="Action:"), tiny_path


def _play(engine, fmt, policy, window=2, horizon=6, max_context=4096, n=4, seed=5, greedy=False):
    specs = [EpisodeSpec("babyai", t, 0, f"g{t}", f"e{t}", {"observation_style": "compact"}) for t in range(n)]
    settings = RolloutSettings(horizon=horizon, max_new_tokens=8, max_context_tokens=max_context, seed=seed,
                               system_prompt=SYSTEM, stop=["\n"], context_policy=policy,
                               context_window=window, greedy=greedy)
    return run_episodes(engine, fmt, specs, settings, make_env)


@pytest.mark.parametrize("policy", ["window", "summary"])
def test_segments_are_the_head_and_the_last_turns(setup, policy):
    engine, fmt, _ = setup
    eps = _play(engine, fmt, policy)
    assert any(ep.context_starts for ep in eps)
    for ep in eps:
        ep.validate()
        runs = mask_runs(ep.loss_mask)
        # token-in/token-out: one run of sampled tokens per turn, decoding to the turn's reply
        assert len(runs) == ep.num_turns
        replies = [ep.input_ids[a:b] for a, b in runs]
        assert [fmt.reply_text(r) for r in replies] == [t.action_text for t in ep.turns]
        # each finished turn as the rollout appended it: the reply and the glue to the next observation
        turn_ids = [replies[k] + fmt.glue(ep.turns[k + 1].observation, fmt.ends_turn(replies[k]))
                    for k in range(ep.num_turns - 1)]
        bounds = [0, *ep.context_starts, len(ep.input_ids)]
        for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
            if s == 0:
                continue
            last = s + 2  # segment s holds the reply of turn window + s (window 2)
            first = last - 2
            kept = [t for k in range(first, last) for t in turn_ids[k]]
            seg = ep.input_ids[a:b]
            ra, rb = runs[last]
            assert a < ra and rb == b  # the segment's one reply ends it
            context = seg[: ra - a]
            assert context[len(context) - len(kept):] == kept
            if policy == "window":  # the first prompt, then the kept turns
                assert context == fmt.start(SYSTEM, ep.turns[0].observation) + kept
            else:  # the system prompt and BabyAI's summary (the goal and the view), then the kept turns
                text = fmt.tokenizer.decode(context[: len(context) - len(kept)])
                assert SYSTEM in text and ep.turns[0].observation.split("\n")[0] in text
            assert ep.loss_mask[a: ra] == [0] * (ra - a)


def test_window_plays_on_where_truncate_stops(setup):
    engine, fmt, _ = setup
    first = len(fmt.start(SYSTEM, _play(engine, fmt, "truncate", horizon=1, n=1)[0].turns[0].observation))
    budget = first + 3 * 40  # room for about three turns of this environment
    cut = _play(engine, fmt, "truncate", horizon=8, max_context=budget)
    kept = _play(engine, fmt, "window", window=1, horizon=8, max_context=budget)
    assert all(ep.truncated for ep in cut) and max(ep.num_turns for ep in cut) < 8
    assert max(ep.num_turns for ep in kept) > max(ep.num_turns for ep in cut)
    for ep in kept:
        bounds = [0, *ep.context_starts, len(ep.input_ids)]
        assert max(b - a for a, b in zip(bounds, bounds[1:])) <= budget


def test_kept_cache_is_rebuilt_when_the_window_moves(setup, tiny_path):
    engine, fmt, _ = setup
    cold = HFEngine(engine.model, fmt.tokenizer, keep_cache=False)
    a = _play(engine, fmt, "window", window=1, greedy=True)
    b = _play(cold, fmt, "window", window=1, greedy=True)
    assert any(ep.context_starts for ep in a)
    assert [e.input_ids for e in a] == [e.input_ids for e in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.old_logprobs), torch.tensor(y.old_logprobs), atol=2e-4, rtol=0)


@pytest.mark.parametrize("policy", ["truncate", "window", "summary"])
def test_trainer_recomputes_the_samplers_logprobs(setup, policy):
    engine, fmt, path = setup
    eps = _play(engine, fmt, policy, window=1)
    tr = PolicyTrainer(path, fmt.tokenizer, TrainerConfig(learning_rate=1e-4, bf16=False), AlgorithmConfig(), seed=0)
    rows = [{"input_ids": e.input_ids, "loss_mask": e.loss_mask, "old_logprobs": e.old_logprobs,
             "advantages": [0.0] * len(e.input_ids), "context_starts": e.context_starts} for e in eps]
    seg_rows, spans = split_rows(rows)
    width = max(len(e.input_ids) for e in eps)
    got = merge_segments(tr.compute(TrainBatch.from_rows(seg_rows, 0), ["logprobs"])["logprobs"], spans,
                         (len(eps), width))
    want = TrainBatch.from_rows(rows, 0)
    mask = want.loss_mask.bool()
    torch.testing.assert_close(got[mask], want.old_logprobs[mask], atol=2e-4, rtol=0)
    if policy != "truncate":  # control: the whole concatenation as one row is not what was sampled
        whole = tr.compute(TrainBatch.from_rows([{k: v for k, v in r.items() if k != "context_starts"}
                                                 for r in rows], 0), ["logprobs"])["logprobs"]
        assert (whole[mask] - want.old_logprobs[mask]).abs().max() > 1e-2


def test_summary_needs_an_environment_that_gives_one(setup):
    engine, fmt, _ = setup
    settings = RolloutSettings(horizon=3, max_new_tokens=4, context_policy="summary")
    with pytest.raises(ValueError, match="context_summary"):
        run_episodes(engine, fmt, [EpisodeSpec("keyword", 0, 0, "g", "e", {"target": "zzz"})], settings, make_env)


def test_the_advantage_step_computes_on_segments(tmp_path, model_cache):
    """PolicySession._compute (what GAE's values and the KL's log-probs go through) lays the
    per-segment forward back on the episode: the sampler's log-probs come back at every reply."""
    from agentgym.pipeline import IterationRef, PolicySession

    cfg = parse_tiny_config(
        model_cache, store_root=tmp_path / "store", system_prompt=SYSTEM,
        envs=[{"name": "babyai", "tasks": [0, 1], "kwargs": {"observation_style": "compact"}}],
        rollout={"max_new_tokens": 8, "response_prefix": "Action:", "stop": ["\n"], "context_policy": "window",
                 "context_window": 1},
        trainer={"learning_rate": DEFAULT}, schedule={"stages": [{"horizon": 5, "iterations": 1}]})
    session = PolicySession(cfg, "segments")
    try:
        session.collect(IterationRef(0, 0, 0), 5)
        episodes = session.store.read_episodes(0, 0, turn_text=False)
        assert any(e.context_starts for e in episodes)  # read back from the store
        episode_batch = EpisodeBatch.from_episodes(episodes)
        batch = episode_batch.padded(session._pad_id())
        got = session._compute(episode_batch, batch, ["logprobs"])["logprobs"]
        mask = batch.loss_mask.bool()
        torch.testing.assert_close(got[mask], batch.old_logprobs[mask], atol=2e-4, rtol=0)
    finally:
        session.close()
