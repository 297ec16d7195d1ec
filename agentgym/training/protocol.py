"""The trainer protocol the pipeline is typed against, and the factory that picks one.

Two implementations: ``training.PolicyTrainer`` (DeepSpeed in this process, world size 1) and
``agentgym.cluster.trainer_group.RayTrainerGroup`` (N ranks as Ray actors, each holding a
``PolicyTrainer``). The
pipeline calls only what is declared here, so it never asks which one it holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from agentgym.config import AlgorithmConfig, RayConfig, TrainerConfig
from agentgym.training.batch import TrainBatch
from agentgym.training.policy_trainer import PolicyTrainer
from agentgym.training.zero_stage import resolve_zero_stage


class GroupError(RuntimeError):
    """A rank of a multi-rank training group died or failed; the group is down (the pipeline
    drops the session, and a re-run resumes from the latest checkpoint)."""


@runtime_checkable
class Trainer(Protocol):
    pad_id: int  # the pad token of TrainBatch rows
    optimizer_steps: int  # optimizer steps taken since the trainer (or its checkpoint) started

    def train_from_store(self, store: dict[str, Any], stage: int, iteration: int,
                         seed: int = 0) -> dict[str, float]:
        """Train on the committed ``train_batch`` table of (stage, iteration) in the trajectory
        store opened by ``store`` (``TrajectoryStore.spec()``); the pipeline's batch path."""

    def train_on_batch(self, batch: TrainBatch, seed: int = 0, objective: str = "ppo",
                       epochs: int | None = None, mini_batches: int | None = None) -> dict[str, float]:
        """Train on an in-memory batch (the SFT stage's demonstrations with ``objective="sft"``;
        tests, benchmarks); ``epochs`` / ``mini_batches`` override the algorithm's."""

    def compute(self, batch: TrainBatch, what: list[str] | tuple[str, ...]) -> dict[str, torch.Tensor]:
        """Forward-only ``logprobs`` / ``ref_logprobs`` / ``values`` of a batch, (B, T) each."""

    def sft_metrics(self, batch: TrainBatch) -> dict[str, float]:
        """``sft_loss`` (token-mean cross-entropy) and ``token_accuracy`` of the batch's loss-mask
        tokens, dropout off, no gradient: the SFT stage's held-out measure."""

    def advance_lr_schedule(self, steps: int) -> None:
        """Step the learning-rate schedule ``steps`` times without training: an SFT resumed from
        weights alone continues its schedule where it was."""

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full policy weights under the base model's names (LoRA merged), for weight sync."""

    def save_adapter(self, out_dir: str | Path) -> Path:
        """Write the LoRA adapter (peft format) alone: the vllm_server engine's weight sync."""

    def save_hf(self, out_dir: str | Path, tokenizer: Any) -> Path:
        """Export the policy (and critic) as an HF folder, ``tokenizer`` saved beside it."""

    def save_checkpoint(self, ckpt_dir: str | Path, client_state: dict[str, Any] | None = None) -> Path:
        """The full training state (DeepSpeed, RNG, step count) for an exact resume."""

    def load_checkpoint(self, ckpt_dir: str | Path) -> dict[str, Any]:
        """Restore ``save_checkpoint``'s state; returns its ``client_state``."""

    def close(self) -> None:
        """Release the trainer (a group's ranks stop); idempotent."""


def create_trainer(model_path: str | Path, tokenizer: Any, trainer: TrainerConfig, algorithm: AlgorithmConfig,
                   temperature: float = 1.0, seed: int = 0, ray_cfg: RayConfig | None = None,
                   action_temperature: float = 1.0) -> Trainer:
    """A ``PolicyTrainer`` in this process, or (``ray_cfg`` given, or ``trainer.world_size`` > 1)
    a ``RayTrainerGroup`` of ``world_size`` rank actors on the cluster ``ray_cfg`` names.
    ``trainer.zero_stage: auto`` follows the trainer state in ``model_path`` when it is a checkpoint
    folder being resumed (``zero_stage.resolve_zero_stage``)."""
    trainer = resolve_zero_stage(trainer, model_path)
    if ray_cfg is None and trainer.world_size == 1:
        return PolicyTrainer(model_path, tokenizer, trainer, algorithm, temperature=temperature, seed=seed,
                             action_temperature=action_temperature)
    from agentgym.cluster.trainer_group import RayTrainerGroup  # Ray is imported only on this path

    return RayTrainerGroup(model_path, tokenizer, trainer, algorithm, temperature=temperature, seed=seed,
                           ray_cfg=ray_cfg, action_temperature=action_temperature)
