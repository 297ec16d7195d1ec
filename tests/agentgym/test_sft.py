"""The SFT objective: closed form, masked-token invariance, and learning from demonstrations
(held-out cross-entropy down, valid-action rate of sampled replies up) with the tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from agentgym import algorithms as A
from agentgym.chat import ChatFormatter
from agentgym.models.folders import load_model
from agentgym.rollout.engines.base import SamplingParams
from agentgym.rollout.engines.hf import HFEngine
from agentgym.training import sft as S
from agentgym.training.demos import generate_demos
from env_adapters import make_env
from env_adapters.babyai import parse_reply
from env_adapters.experts import make_expert

from configs import DEFAULT, parse_tiny_config  # tests/ is on sys.path

LEVELS = (1, 2, 3, 5)  # GoTo levels the expert always solves
TRAIN = [lv - 1 + 40 * k for k in range(0, 12) for lv in LEVELS]
HELDOUT = [lv - 1 + 40 * k for k in range(200, 204) for lv in LEVELS]


def test_sft_loss_closed_form_and_masked_invariance():
    lp = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-0.5, -0.25, -9.0, -9.0]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]])
    loss, m = A.sft_loss(lp, mask)
    assert float(loss) == pytest.approx((2.0 + 3.0 + 0.25) / 3)  # token mean of -logp on the mask
    assert m["sft_loss"] == pytest.approx(float(loss))
    noisy = torch.where(mask.bool(), lp, torch.randn_like(lp) * 100)
    assert float(A.sft_loss(noisy, mask)[0]) == float(loss)
    seq, _ = A.sft_loss(lp, mask, "seq-mean-token-mean")
    assert float(seq) == pytest.approx(((2.0 + 3.0) / 2 + 0.25) / 2)


def test_epoch_order_covers_every_demo_once_and_is_seeded():
    order = S.epoch_order(10, 4, seed=1, epoch=0)
    assert [len(c) for c in order] == [4, 4, 2] and sorted(i for c in order for i in c) == list(range(10))
    assert order == S.epoch_order(10, 4, seed=1, epoch=0) != S.epoch_order(10, 4, seed=1, epoch=1)


def _config(model_cache, **sft):
    # no RL iteration: the rollout's batch shape and the trainer's learning rate stay the library's
    return parse_tiny_config(
        model_cache, envs=[{"name": "babyai", "tasks": TRAIN, "eval_tasks": HELDOUT}],
        rollout={"tasks_per_iteration": DEFAULT, "group_size": DEFAULT, "response_prefix": "Action:", "stop": ["\n"],
                 "max_new_tokens": 12},
        trainer={"learning_rate": DEFAULT, "micro_batch_size": 8},
        sft={"enabled": True, "episodes": 48, "epochs": 4, "batch_size": 8, "learning_rate": 3e-3, **sft},
        schedule={"stages": [{"horizon": 4, "iterations": 1}]})


def _valid_action_rate(engine: HFEngine, fmt: ChatFormatter, tasks: list[int], samples: int) -> float:
    """Share of sampled first-turn replies that name one of the listed valid actions. Sampled at
    temperature 0.3: the random-init tiny model's tied 0.02-std embeddings keep its logits near
    uniform, so at 1.0 even a well-fitted tiny model samples noise (SmolLM2 does not)."""
    env = make_env("babyai")
    prompts, valid = [], []
    for t in tasks:
        obs, _ = env.reset(t, 0)
        prompts += [fmt.start(env.system_prompt(), obs)] * samples
        valid += [set(env.valid_actions())] * samples
    env.close()
    out = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.3, seed=5,
                                                  stop_token_ids=fmt.end_of_turn_ids, stop_strings=["\n"]))
    ok = [parse_reply(fmt.reply_text(s.token_ids))[0] in v for s, v in zip(out, valid)]
    return sum(ok) / len(ok)


@pytest.mark.slow
def test_sft_learns_the_demonstrations(tiny_path, model_cache):
    cfg = _config(model_cache)
    model, tok = load_model(tiny_path, "float32")
    fmt = ChatFormatter(tok, "Action:")
    common = dict(horizon=12, stop=["\n"], system_prompt=None, noise=0.0, make_env=make_env, make_expert=make_expert)
    train, _ = generate_demos(fmt, [("babyai", TRAIN, {})], episodes=48, seed=0, **common)
    held, _ = generate_demos(fmt, [("babyai", HELDOUT, {})], episodes=16, seed=1, **common)
    engine = HFEngine(model, tok)
    valid_before = _valid_action_rate(engine, fmt, HELDOUT, 4)

    steps = S.steps_per_epoch(len(train), cfg.sft.batch_size) * cfg.sft.epochs
    trainer = S.build_trainer(cfg, tiny_path, tok, steps)
    before = trainer.sft_metrics(S.as_batch(held, trainer.pad_id))
    logged = []
    step = 0
    for epoch in range(cfg.sft.epochs):
        step = S.train_epoch(trainer, train, cfg, epoch, step, lambda s, m: logged.append((s, m)))
    after = trainer.sft_metrics(S.as_batch(held, trainer.pad_id))
    engine.update_weights(trainer.named_weights())
    valid_after = _valid_action_rate(engine, fmt, HELDOUT, 4)
    trainer.close()

    assert [s for s, _ in logged] == list(range(1, steps + 1))
    assert all(math.isfinite(m["sft_loss"]) and 0 <= m["token_accuracy"] <= 1 for _, m in logged)
    assert logged[-1][1]["lr"] < logged[0][1]["lr"]  # warmup-free cosine decay
    print("held-out", before, after, "valid actions", valid_before, valid_after)
    # the line above prints what the bars below are read against (pytest -s); they ask for a
    # clear gain, not for one run's figures
    assert after["sft_loss"] < 0.5 * before["sft_loss"], (before, after)
    assert after["token_accuracy"] > before["token_accuracy"] + 0.3
    assert valid_after >= valid_before + 0.25, (valid_before, valid_after)


def test_train_layers_freezes_everything_below(tiny_path, model_cache):
    cfg = _config(model_cache)
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"train_layers": 1})})
    model, tok = load_model(tiny_path, "float32")
    fmt = ChatFormatter(tok, "Action:")
    demos, _ = generate_demos(fmt, [("babyai", TRAIN, {})], episodes=8, seed=0, horizon=12, stop=["\n"],
                              system_prompt=None, noise=0.0, make_env=make_env, make_expert=make_expert)
    trainer = S.build_trainer(cfg, tiny_path, tok, 1)
    before = {k: v.clone() for k, v in trainer.named_weights()}
    S.train_epoch(trainer, demos, cfg, 0, 0)
    after = dict(trainer.named_weights())
    trainer.close()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    top = max(int(k.split("layers.")[1].split(".")[0]) for k in before if "layers." in k)
    assert changed and all(f"layers.{top}." in k or k.endswith("norm.weight") and "layers" not in k for k in changed)
    assert not any("embed" in k for k in changed)


def test_demonstrations_stop_after_attempts_per_episode_and_say_how_to_get_more(model_cache, tmp_path,
                                                                                 monkeypatch):
    """sft.attempts_per_episode bounds the expert's attempts (x the demonstrations wanted); too few
    successes is an error naming the settings that would give more."""
    import tasks.sft as T
    from agentgym.training.demos import DemoStats

    seen: list[int] = []

    def expert_fails_all(*args, episodes, max_attempts, **kwargs):
        seen.append(max_attempts)
        return [], DemoStats(attempted=max_attempts)

    monkeypatch.setattr(T, "generate_demos", expert_fails_all)
    cfg = _config(model_cache, episodes=2, heldout_episodes=0, attempts_per_episode=3)
    cfg = cfg.model_copy(update={"store": cfg.store.model_copy(update={"root": str(tmp_path / "store")})})
    with pytest.raises(RuntimeError, match=r"solved only 0 of 6 train attempts") as err:
        T.generate_demonstrations.fn(cfg)
    assert seen == [6] and "sft.attempts_per_episode" in str(err.value)
