"""A NaN/Inf loss or gradient never reaches the weights: the real DeepSpeed trainer skips that
optimizer step (weights, AdamW state, LR schedule and DeepSpeed's counters bit-identical),
counts it in a metric that reaches MLflow, and stops with a clear error after
``trainer.max_nonfinite_skips`` skips in a row. (A NaN reward from an environment is stopped
earlier, at the rollout: tests/agentgym/test_rollout.py.)"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from transformers import AutoTokenizer

from agentgym.config import AlgorithmConfig, TrainerConfig
from agentgym.tracking.tracker import Tracker
from agentgym.training.batch import TrainBatch
from agentgym.training.finite import NonFiniteTrainingError
from agentgym.training.policy_trainer import PolicyTrainer
from batches import synthetic_batch  # tests/ is on sys.path
from configs import tiny_trainer


def _batch(vocab: int = 512, n: int = 6, seed: int = 0) -> TrainBatch:
    return synthetic_batch(vocab, n, seed, segments=1)


def _poisoned(batch: TrainBatch, value: float = float("nan")) -> TrainBatch:
    """One policy token's advantage is NaN (or Inf): the loss and every gradient become NaN."""
    adv = batch.advantages.clone()
    adv[0, 7] = value
    return TrainBatch(**{**batch.tensors(), "advantages": adv})


def _trainer(path: str, **kw) -> PolicyTrainer:
    tok = AutoTokenizer.from_pretrained(path)
    cfg = tiny_trainer(**{"micro_batch_size": 3, **kw})
    return PolicyTrainer(path, tok, cfg, AlgorithmConfig(ppo_epochs=1, mini_batches=1), seed=0)


def _state(tr: PolicyTrainer) -> dict[str, object]:
    """Everything a skipped step must leave as it was: the live weights, AdamW's master weights,
    moments and step counts, its learning rates, the LR schedule and DeepSpeed's step counters."""
    base = getattr(tr.optimizer, "optimizer", tr.optimizer)  # ZeRO / bf16 wrap the AdamW we passed
    return {
        "weights": [t.detach().clone() for _, t in tr.named_weights()],
        "master": [p.detach().clone() for g in base.param_groups for p in g["params"]],
        "adam": [(k, v.clone() if torch.is_tensor(v) else v)
                 for st in base.state.values() for k, v in sorted(st.items())],
        "lr": [g["lr"] for g in base.param_groups],
        "schedule": tr.lr_scheduler.state_dict(),
        "counters": (tr.engine.global_steps, tr.engine.global_samples, tr.optimizer_steps),
    }


def _assert_same(a: dict[str, object], b: dict[str, object]) -> None:
    for key in a:
        if key in ("weights", "master"):
            assert len(a[key]) == len(b[key]) and all(torch.equal(x, y) for x, y in zip(a[key], b[key])), key
        elif key == "adam":
            assert len(a[key]) > 0 and len(a[key]) == len(b[key]), key  # a good step made moments
            for (k1, v1), (k2, v2) in zip(a[key], b[key]):
                assert k1 == k2 and (torch.equal(v1, v2) if torch.is_tensor(v1) else v1 == v2), (key, k1)
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("stage,bf16", [(0, False), (2, True), (3, False)])
def test_a_nan_loss_skips_the_step_and_leaves_no_trace(tiny_path, stage, bf16):
    """ZeRO-0 fp32 is the case DeepSpeed does not catch by itself (a NaN gradient became NaN
    weights); ZeRO-2 bf16 and ZeRO-3 keep their gradients in their own buffers."""
    tr = _trainer(tiny_path, zero_stage=stage, bf16=bf16)
    good = _batch()
    tr.train_on_batch(good, seed=1)  # AdamW has moments and a step count now
    before = _state(tr)
    skipped_before = tr.engine.skipped_steps
    out = tr.train_on_batch(_poisoned(good), seed=2)
    assert out["nonfinite_skips"] == 1 and out["optimizer_steps"] == 0
    assert math.isnan(out["loss"])  # no applied step to report a loss for
    _assert_same(before, _state(tr))
    assert tr.engine.skipped_steps == skipped_before + 1 and tr.nonfinite_streak == 1
    # the NaN gradients were cleared too: the next good step is the one a trainer that never saw
    # the poison takes, bit for bit (checked at the default stage; elsewhere: finite and moving)
    after = tr.train_on_batch(good, seed=3)
    assert after["optimizer_steps"] == 1 and after["nonfinite_skips"] == 0 and tr.nonfinite_streak == 0
    got = [t.detach().clone() for _, t in tr.named_weights()]
    assert all(torch.isfinite(t).all() for t in got)
    assert any(not torch.equal(x, y) for x, y in zip(got, before["weights"]))
    if stage == 2:
        ref = _trainer(tiny_path, zero_stage=stage, bf16=bf16)
        ref.train_on_batch(good, seed=1)
        ref.train_on_batch(good, seed=3)
        assert all(torch.equal(x, y.detach()) for x, (_, y) in zip(got, ref.named_weights()))


def test_a_nan_gradient_under_a_finite_loss_is_skipped(tiny_path, caplog):
    """The loss is fine, but a backward hook turns the embedding's gradient into NaN: the
    gradient check (not the loss check) skips the step."""
    tr = _trainer(tiny_path, zero_stage=0)
    good = _batch()
    tr.train_on_batch(good, seed=1)
    before = _state(tr)
    emb = tr.module.get_input_embeddings()

    def poison_backward(module, inputs, output):
        output.register_hook(lambda grad: torch.full_like(grad, float("nan")))

    handle = emb.register_forward_hook(poison_backward)
    with caplog.at_level(logging.WARNING, logger="agentgym.training.policy_trainer"):
        out = tr.train_on_batch(good, seed=2)
    handle.remove()
    assert out["nonfinite_skips"] == 1 and out["optimizer_steps"] == 0
    assert "a non-finite gradient" in caplog.text
    _assert_same(before, _state(tr))


def test_skips_in_a_row_stop_training_and_the_counter_reaches_mlflow(tiny_path, tmp_path):
    tr = _trainer(tiny_path, zero_stage=0, max_nonfinite_skips=2)
    good, bad = _batch(), _poisoned(_batch(), float("inf"))
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "nonfinite")
    run = tracker.client.create_run(tracker.experiment_id).info.run_id
    for step, batch in enumerate([bad, good, bad]):  # an applied step in between restarts the count
        tracker.log_metrics(run, tr.train_on_batch(batch, seed=step), step=step)
    assert tr.nonfinite_streak == 1 and tr.nonfinite_skips == 2
    history = tracker.client.get_metric_history(run, "nonfinite_skips")
    assert sorted((m.step, m.value) for m in history) == [(0, 1.0), (1, 0.0), (2, 1.0)]
    with pytest.raises(NonFiniteTrainingError, match=r"2 optimizer steps in a row had a non-finite loss.*"
                                                     r"trainer\.max_nonfinite_skips=2"):
        tr.train_on_batch(bad, seed=3)
    assert TrainerConfig.model_fields["max_nonfinite_skips"].description
