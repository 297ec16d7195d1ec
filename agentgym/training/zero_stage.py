"""Which DeepSpeed ZeRO stage a trainer runs (``trainer.zero_stage: auto``), and which stage a
trainer checkpoint was written at.

One rank has nothing to partition, yet ZeRO-1/2 still copy every gradient into their flat
partition buffers, a large share of an all-layer update on a CPU (bench/README.md sections 4 and
13 have the measurements). So auto is ZeRO-0 for one rank in fp32 and ZeRO-2 otherwise
(``default_stage`` says why bf16 keeps 2). DeepSpeed cannot load a checkpoint written at another
stage (its optimizer state has another layout), so auto follows the stage of the checkpoint a run
resumes from, and ``PolicyTrainer.load_checkpoint`` refuses a mismatch with the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

from agentgym.config import TrainerConfig
from agentgym.models.hardware import resolve_bf16

#: the sub-folder of an exported checkpoint folder that holds the trainer (DeepSpeed) state
TRAINER_STATE = "trainer_state"
#: DeepSpeed's tag (subfolder) inside a trainer checkpoint folder
CHECKPOINT_TAG = "ds"
#: written beside DeepSpeed's files in a checkpoint's tag folder
STATE_FILE = "agentgym_trainer.json"


def default_stage(world_size: int, bf16: bool) -> int:
    """auto's stage for a fresh run: 0 for one rank training in fp32, else 2. In bf16 DeepSpeed's
    ZeRO-0 steps through another optimizer (``BF16_Optimizer``) than ZeRO-2's, and the quickstart
    (bf16 where the CPU has it) ended lower with it (bench/README.md section 4); until that is
    understood, bf16 keeps the stage its results were measured at."""
    return 0 if world_size == 1 and not bf16 else 2


def checkpoint_stages(tag_dir: str | Path) -> frozenset[int]:
    """The ZeRO stages a checkpoint's tag folder (``<ckpt>/ds``) can have been written at: the
    one it records (``STATE_FILE``), else (checkpoints written before it) what DeepSpeed's file
    names allow: per-rank model states only at ZeRO-3, per-rank optimizer states at ZeRO-1/2
    (ZeRO-0 with bf16 names them ``bf16_...``), none at ZeRO-0 in fp32. Empty: no checkpoint."""
    tag = Path(tag_dir)
    if (tag / STATE_FILE).is_file():
        return frozenset({int(json.loads((tag / STATE_FILE).read_text())["zero_stage"])})
    names = [p.name for p in tag.glob("*.pt")] if tag.is_dir() else []
    if not names:
        return frozenset()
    if any(n.startswith("zero_pp_rank_") and n.endswith("_model_states.pt") for n in names):
        return frozenset({3})
    if any(n.startswith("zero_pp_rank_") and n.endswith("_optim_states.pt") for n in names):
        return frozenset({1, 2})
    return frozenset({0})


def resolve_zero_stage(trainer: TrainerConfig, weights: str | Path | None = None) -> TrainerConfig:
    """``trainer`` with a numeric ``zero_stage``: an explicit stage as it is; auto as the stage of
    the trainer state in ``weights`` (a checkpoint folder being resumed, ``TRAINER_STATE``) where
    there is one, else ``default_stage``."""
    if trainer.zero_stage != "auto":
        return trainer
    stage = default_stage(trainer.world_size, resolve_bf16(trainer.bf16))
    if weights is not None:
        written = checkpoint_stages(Path(weights) / TRAINER_STATE / CHECKPOINT_TAG)
        if written and stage not in written:
            stage = max(written)
    return trainer.model_copy(update={"zero_stage": stage})
