"""Test helper: distinct HF checkpoints of the tiny model and an MLflow stage run to log them to."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from agentgym.tracking.tracker import Tracker

WEIGHTS = "model.safetensors"


def variant(src: str | Path, dst: str | Path, step: int) -> Path:
    """A copy of HF folder ``src`` whose every floating weight is shifted by ``step / 1000``:
    the checkpoint of step ``step``, distinguishable from every other step's."""
    dst = Path(dst)
    shutil.copytree(src, dst)
    state = load_file(dst / WEIGHTS)
    save_file({k: (v + step / 1000 if v.is_floating_point() else v).contiguous() for k, v in state.items()},
              str(dst / WEIGHTS), metadata={"format": "pt"})
    return dst


def weights(folder: str | Path) -> dict[str, torch.Tensor]:
    return load_file(Path(folder) / WEIGHTS)


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def stage_run(tmp: Path, artifact_location: str | None = None, run_id: str = "ckpt") -> tuple[Tracker, str]:
    """A tracker on a SQLite DB in ``tmp`` and the MLflow run of stage 0 of pipeline ``run_id``."""
    tracker = Tracker(f"sqlite:///{tmp}/mlflow.db", "reliability", artifact_location=artifact_location)
    parent = tracker.pipeline_run(run_id, {"run_id": run_id})
    return tracker, tracker.stage_run(parent, run_id, 0, horizon=1, iterations=3)


def run_child(ctx, target, *args, timeout: float = 120) -> int:
    """Run ``target(*args)`` in a child of fork server ``ctx``; its exit code (-9: killed)."""
    p = ctx.Process(target=target, args=args)
    p.start()
    p.join(timeout=timeout)
    assert p.exitcode is not None, f"the checkpoint child {target.__name__} hung"
    return p.exitcode
