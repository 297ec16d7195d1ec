"""The SFT warm start's library steps: demonstrations in, a fine-tuned policy out.

The stage trains the same DeepSpeed ``PolicyTrainer`` as the RL updates (ZeRO, micro-batches,
LoRA) with ``objective="sft"``: the cross-entropy of the expert's reply tokens only (the
episodes' ``loss_mask``), one optimizer step per ``sft.batch_size`` demonstrations. Its own
learning rate (``sft.learning_rate``, warmup then cosine decay to 10 %) replaces the RL one;
every other trainer setting is shared.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from agentgym.config import PipelineConfig, TrainerConfig
from agentgym.training.batch import TrainBatch
from agentgym.training.demos import demos_dataset_id
from agentgym.training.protocol import Trainer, create_trainer
from agentgym.types import Episode

#: the demonstrations' partitions in their dataset (stage 0): training and held-out sets
TRAIN_PART, HELDOUT_PART = 0, 1


def demo_dataset(cfg: PipelineConfig, tokenizer_name: str) -> str:
    """The store run id of the config's demonstration set (see ``demos_dataset_id``)."""
    s = cfg.sft
    return demos_dataset_id({
        "envs": [e.model_dump(mode="json", exclude={"weight"}) for e in cfg.envs],
        "episodes": s.episodes, "heldout": s.heldout_episodes, "horizon": s.horizon,
        "noise": s.noise, "seed": s.seed, "system_prompt": cfg.system_prompt,
        "response_prefix": cfg.rollout.response_prefix, "stop": cfg.rollout.stop,
        "tokenizer": tokenizer_name, "format": 1,
    })


def steps_per_epoch(n_demos: int, batch_size: int) -> int:
    return max(1, math.ceil(n_demos / batch_size))


def sft_trainer_config(cfg: PipelineConfig, total_steps: int) -> TrainerConfig:
    """The RL trainer's settings with the SFT stage's learning rate and schedule."""
    s = cfg.sft
    schedule = "cosine" if total_steps > s.warmup_steps else "constant"
    return cfg.trainer.model_copy(update={
        "learning_rate": s.learning_rate, "lr_schedule": schedule, "lr_warmup_steps": s.warmup_steps,
        "lr_decay_steps": total_steps if schedule == "cosine" else 0, "lr_min_ratio": 0.1,
    })


def as_batch(episodes: list[Episode], pad_id: int) -> TrainBatch:
    """Demonstrations as a ``TrainBatch`` (advantages and old log-probs unused by the SFT loss)."""
    rows = [{"input_ids": e.input_ids, "loss_mask": e.loss_mask, "old_logprobs": [0.0] * len(e.input_ids),
             "advantages": [0.0] * len(e.input_ids)} for e in episodes]
    return TrainBatch.from_rows(rows, pad_id)


def epoch_order(n: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """The demonstrations' indices of each optimizer step of ``epoch``: a seeded shuffle cut into
    ``batch_size`` chunks (a pure function, so a resumed epoch replays the same steps)."""
    idx = list(range(n))
    random.Random(f"{seed}:sft:{epoch}").shuffle(idx)
    return [idx[i:i + batch_size] for i in range(0, n, batch_size)]


@dataclass
class SFTState:
    """Where a (possibly resumed) SFT stage stands: optimizer steps and epochs done."""

    step: int = 0
    epoch: int = 0


def build_trainer(cfg: PipelineConfig, weights: str | Path, tokenizer: PreTrainedTokenizerBase,
                  total_steps: int) -> Trainer:
    """A trainer over ``weights`` with the SFT settings (no KL reference, no critic)."""
    algo = cfg.algorithm.model_copy(update={"kl_coef": 0.0, "kl_in_reward": False, "critic":
                                            cfg.algorithm.critic.model_copy(update={"model": "none"}),
                                            "estimator": "grpo" if cfg.algorithm.estimator.value == "gae"
                                            else cfg.algorithm.estimator})
    # a group of ranks goes to the cluster the run's ray section names, placed as it says (world
    # size 1 and no ray.address: in this process, whatever rollout.workers is)
    grouped = cfg.ray.address is not None or cfg.trainer.world_size > 1
    return create_trainer(weights, tokenizer, sft_trainer_config(cfg, total_steps), algo,
                          temperature=1.0, seed=cfg.sft.seed, ray_cfg=cfg.ray if grouped else None)


def train_epoch(trainer: Trainer, demos: list[Episode], cfg: PipelineConfig, epoch: int,
                first_step: int, on_step: Callable[[int, dict[str, Any]], None] | None = None) -> int:
    """One pass over ``demos``: an optimizer step per chunk of ``epoch_order``; ``on_step(step,
    metrics)`` after each (``sft_loss``, ``token_accuracy``, ``lr``, ``grad_norm``...). Returns
    the step count after the epoch."""
    step = first_step
    for chunk in epoch_order(len(demos), cfg.sft.batch_size, cfg.sft.seed, epoch):
        batch = as_batch([demos[i] for i in chunk], trainer.pad_id)
        metrics = trainer.train_on_batch(batch, seed=cfg.sft.seed * 7919 + step, objective="sft",
                                         epochs=1, mini_batches=1)
        metrics["epoch"] = float(epoch)
        metrics["demo_tokens"] = float(sum(len(demos[i].input_ids) for i in chunk))
        step += 1
        if on_step:
            on_step(step, metrics)
    return step
