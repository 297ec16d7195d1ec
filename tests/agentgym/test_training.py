"""DeepSpeed trainer: optimizer-step accounting, exact micro-batch accumulation, learning."""

import time

import pytest
import torch
from transformers import AutoTokenizer

from agentgym.config import AlgorithmConfig, TrainerConfig, parse_config
from agentgym.pipeline import IterationRef, PolicySession
from agentgym.training import PolicyTrainer, TrainBatch


def _batch(vocab: int, n: int = 8, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = 12 + i
        ids = torch.randint(6, vocab, (length,), generator=g).tolist()
        mask = [0] * 5 + [1] * 4 + [0] * 2 + [1] * (length - 11)  # two policy segments
        rows.append({
            "input_ids": ids, "loss_mask": mask,
            "old_logprobs": [(-3.0 if m else 0.0) for m in mask],
            "advantages": [(float(i % 3) - 1.0) * m for m in mask],
        })
    return TrainBatch.from_rows(rows, pad_id=0)


def _trainer(path, **kw) -> PolicyTrainer:
    algo = kw.pop("algo", {})
    tok = AutoTokenizer.from_pretrained(path)
    cfg = TrainerConfig(learning_rate=1e-3, bf16=False, **kw)
    return PolicyTrainer(path, tok, cfg, AlgorithmConfig(**algo), seed=0)


def _params(tr: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().float() for k, v in tr.module.named_parameters()}


def test_ppo_epochs_and_mini_batches_count_optimizer_steps(tiny_path):
    tr = _trainer(tiny_path, micro_batch_size=2, algo={"ppo_epochs": 2, "mini_batches": 2})
    before = _params(tr)
    metrics = tr.train_on_batch(_batch(512))
    assert metrics["optimizer_steps"] == 4 and tr.optimizer_steps == 4
    assert tr.engine.global_steps == 4  # DeepSpeed itself counted 4 optimizer steps
    after = _params(tr)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    for key in ("policy_loss", "entropy", "clipfrac", "approx_kl", "grad_norm"):
        assert key in metrics


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                      "seq-mean-token-sum-norm"])
def test_micro_batch_accumulation_is_exact(tiny_path, loss_agg):
    """One mini-batch in 1, 2 or 8 micro-batches gives the same update."""
    batch = _batch(512)
    results = []
    for micro in (8, 3, 1):
        tr = _trainer(tiny_path, micro_batch_size=micro, zero_stage=2, algo={"loss_agg": loss_agg})
        tr.train_on_batch(batch)
        results.append(_params(tr))
    for other in results[1:]:
        for k in results[0]:
            assert torch.allclose(results[0][k], other[k], atol=2e-6), (loss_agg, k)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_agree(tiny_path, stage):
    base = _trainer(tiny_path, micro_batch_size=4, zero_stage=0)
    base.train_on_batch(_batch(512))
    tr = _trainer(tiny_path, micro_batch_size=4, zero_stage=stage)
    tr.train_on_batch(_batch(512))
    if stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(tr.module.parameters())):
            got = _params(tr)
    else:
        got = _params(tr)
    want = _params(base)
    for k in want:
        assert torch.allclose(want[k], got[k], atol=2e-6), (stage, k)


def test_kl_to_reference_is_reported(tiny_path):
    tr = _trainer(tiny_path, micro_batch_size=4, algo={"kl_coef": 0.1, "ppo_epochs": 2})
    m = tr.train_on_batch(_batch(512))
    assert m["kl"] >= 0.0 and tr.ref is not None


LEARN = {"grpo": 15, "rloo": 15, "reinforce_pp": 15}


@pytest.mark.parametrize("estimator", sorted(LEARN))
def test_learning_sanity_reward_goes_up(tmp_path, model_cache, estimator):
    """A trivially learnable task: share of the reply's letters in 'aeiou' (dense reward)."""
    cfg = parse_config({
        "seed": 0, "model": {"name_or_path": "tiny", "dtype": "float32", "cache_dir": model_cache},
        "envs": [{"name": "keyword", "tasks": list(range(8)), "kwargs": {"target": "aeiou", "mode": "char_share"}}],
        "rollout": {"tasks_per_iteration": 4, "group_size": 4, "max_new_tokens": 8},
        "algorithm": {"estimator": estimator, "ppo_epochs": 2, "mini_batches": 2},
        "trainer": {"learning_rate": 5e-3, "bf16": False, "micro_batch_size": 8},
        "schedule": {"stages": [{"horizon": 1, "iterations": LEARN[estimator]}]},
        "store": {"root": str(tmp_path / "store")},
    })
    session = PolicySession(cfg, f"learn-{estimator}")
    before = {k: v.clone() for k, v in session.engine.model.state_dict().items()}
    rewards = []
    t0 = time.perf_counter()
    for step in range(LEARN[estimator]):
        ref = IterationRef(0, step, step)
        rewards.append(session.collect(ref, horizon=1)["reward_mean"])
        session.advantages(ref)
        session.update(ref)
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"{estimator}: reward {first:.3f} -> {last:.3f} in {len(rewards)} iterations "
          f"({time.perf_counter() - t0:.1f} s): {[round(r, 2) for r in rewards]}")
    assert last > first + 0.2, rewards
    after = session.engine.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the rollout engine got the new weights
