"""Expert demonstrations as episodes: reply tokens, masks, noise turns, determinism, the store."""

from __future__ import annotations

import pandas as pd
import pytest

from agentgym.chat import ChatFormatter
from agentgym.training.demos import (EXPERT_POLICY_VERSION, demos_dataset_id, generate_demos,
                            trim_after_last_reply)
from agentgym.models.folders import load_model
from agentgym.store.trajectory_store import TrajectoryStore
from env_adapters import make_env
from env_adapters.babyai import parse_reply
from env_adapters.experts import make_expert

# GoTo levels the BabyAI expert solves (level = idx % 40 + 1: 1, 2, 3, 5)
TASKS = [0, 1, 2, 4, 40, 41, 42, 44]


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    return load_model(tiny_path, "float32")[1]


def _demos(tokenizer, prefix="Action:", stop=("\n",), noise=0.0, seed=0, n=6):
    fmt = ChatFormatter(tokenizer, prefix)
    return generate_demos(fmt, [("babyai", TASKS, {})], episodes=n, horizon=12, stop=list(stop),
                          system_prompt=None, noise=noise, seed=seed, make_env=make_env, make_expert=make_expert)


def test_reply_ids_say_the_action_in_the_rollout_format(tokenizer):
    fmt = ChatFormatter(tokenizer, "Action:")
    ids = fmt.action_reply_ids("go to red ball 1", ["\n"])
    # what the engine returns when it stops on "\n": the reply text ends with the stop string
    assert fmt.reply_text(ids) == "Action: go to red ball 1\n"
    assert not fmt.ends_turn(ids)
    assert parse_reply(fmt.reply_text(ids)) == ("go to red ball 1", "")
    react = ChatFormatter(tokenizer, "")
    ids = react.action_reply_ids("turn left", [])
    assert react.ends_turn(ids)  # a ReAct reply closes its turn with the end-of-turn token
    assert react.reply_text(ids).endswith("Action:\nturn left")
    assert parse_reply(react.reply_text(ids)) == ("turn left", "")


def test_demonstrations_succeed_and_mask_only_the_experts_replies(tokenizer):
    demos, stats = _demos(tokenizer)
    assert len(demos) == stats.kept == 6 and stats.success_rate == 1.0
    fmt = ChatFormatter(tokenizer, "Action:")
    for ep in demos:
        ep.validate()
        assert ep.success and ep.reward > 0
        # the masked runs are exactly the expert's replies, one per turn
        runs, cur = [], []
        for tok, m in zip(ep.input_ids, ep.loss_mask):
            if m:
                cur.append(tok)
            elif cur:
                runs.append(cur)
                cur = []
        runs += [cur] if cur else []
        assert [fmt.reply_text(r) for r in runs] == [t.action_text for t in ep.turns]
        assert ep.loss_mask[-1] == 1  # trimmed after the last reply
    assert stats.reply_tokens == sum(sum(e.loss_mask) for e in demos)


def test_noise_turns_are_context_not_targets(tokenizer):
    demos, stats = _demos(tokenizer, noise=0.5, n=6)
    assert stats.noise_turns > 0
    for ep in demos:
        trained = sum(1 for t in ep.turns if t.gen_tokens)
        runs = sum(1 for a, b in zip([0] + ep.loss_mask, ep.loss_mask) if b and not a)
        assert runs == trained  # noise replies (gen_tokens 0) carry no loss


def test_deterministic_in_the_seed(tokenizer):
    a, _ = _demos(tokenizer, noise=0.3, seed=3)
    b, _ = _demos(tokenizer, noise=0.3, seed=3)
    c, _ = _demos(tokenizer, noise=0.3, seed=4)
    assert [e.input_ids for e in a] == [e.input_ids for e in b]
    assert [e.input_ids for e in a] != [e.input_ids for e in c]


def test_trim_keeps_every_trained_token():
    from agentgym.types import Episode

    ep = Episode("e", "g", "babyai", 0, 0, 4)
    ep.append([1, 2, 3], sampled=False)
    ep.append([4, 5], sampled=True, logprobs=[0.0, 0.0])
    ep.append([6, 7], sampled=False)
    t = trim_after_last_reply(ep)
    assert t.input_ids == [1, 2, 3, 4, 5] and t.loss_mask == [0, 0, 0, 1, 1]


def test_stored_demonstrations_read_like_rollouts(tokenizer, tmp_path):
    demos, _ = _demos(tokenizer, n=4)
    dataset = demos_dataset_id({"envs": TASKS, "n": 4})
    assert dataset == demos_dataset_id({"n": 4, "envs": TASKS}) != demos_dataset_id({"envs": TASKS, "n": 5})
    store = TrajectoryStore(str(tmp_path), dataset)
    store.write_episodes(demos, stage=0, iteration=0, global_step=0, policy_version=EXPERT_POLICY_VERSION)
    df = pd.read_parquet(tmp_path / dataset / "episodes")
    assert len(df) == 4 and df.success.all() and (df.policy_version == EXPERT_POLICY_VERSION).all()
    turns = pd.read_parquet(tmp_path / dataset / "turns")
    assert turns.action_text.str.startswith("Action: ").all() and not turns.format_error.any()
    back = store.read_episodes(0, 0)
    assert [e.input_ids for e in back] == [e.input_ids for e in demos]
