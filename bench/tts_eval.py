"""The one evaluator of ``bench/time_to_success.py``: every arm's checkpoints, and the base model
once, scored by the same code on the same held-out set.

It is this project's held-out evaluation (``tasks/heldout.py``'s ``heldout_policy`` without its
Prefect and MLflow logging): the quickstart's config with the held-out tasks as the BabyAI
``eval_tasks``, the rollout engine ``engine_for`` builds over the HF folder (``hf``, the weights
in the config's ``model.dtype``), ``agentgym.evaluation.metrics.evaluate`` greedy (``k`` 1) at the
held-out horizon with ``heldout.seed``. Greedy decoding among the turn's valid actions
(``rollout.constrain_actions``): each reply is the valid action the policy finds likeliest.
Runs in the main venv, on HF folders: ours' stage checkpoints (materialised from MLflow) and the
folders a TRL arm saves at the same iteration counts.

``score`` results are cached in a JSON beside the folder's record (``Scores``) so a re-run, or
a second arm, does not play the same evaluation again.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "quickstart.yaml"


def heldout_overrides(model: str, tasks: list[int], horizon: int) -> list[str]:
    """``--set`` values over configs/quickstart.yaml: the folder to score, the held-out tasks,
    the held-out horizon."""
    return [f"model.name_or_path={model}", f"envs.0.eval_tasks={json.dumps(list(tasks))}",
            f"heldout.horizon={horizon}"]


def score(folder: str | Path, tasks: list[int], horizon: int) -> dict[str, Any]:
    """Greedy held-out success of the HF folder ``folder``: ``success`` (mean over tasks),
    ``tasks`` (per task 0/1, in ``tasks`` order), ``seconds``."""
    from agentgym.chat import ChatFormatter
    from agentgym.config import load_config
    from agentgym.evaluation.metrics import evaluate
    from agentgym.rollout.engines import engine_for

    t0 = time.perf_counter()
    cfg = load_config(CONFIG, heldout_overrides(str(folder), tasks, horizon))
    engine, tok = engine_for(cfg, folder)
    try:
        report = evaluate(engine, ChatFormatter(tok, cfg.rollout.response_prefix), cfg, k=1, horizon=horizon,
                          greedy=True, seed=cfg.heldout.seed)
    finally:
        engine.close()
    by_task = {t.task_id: t.avg() for t in report.tasks}
    per_task = [float(by_task[t]) for t in tasks]
    return {"success": report.score, "tasks": per_task, "seconds": time.perf_counter() - t0,
            "dtype": cfg.model.dtype, "horizon": horizon, "seed": cfg.heldout.seed}


def fingerprint(folder: str | Path) -> list[Any]:
    """What identifies the weights in an HF folder without reading them: each weights file's
    name, size and modification time (a folder written again gets a new key)."""
    files = sorted(Path(folder).glob("*.safetensors")) + sorted(Path(folder).glob("*.bin"))
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def key(what: str | Path, tasks: list[int], horizon: int) -> str:
    """A cache key for scoring ``what`` (an HF folder, with its ``fingerprint``) on these tasks
    at this horizon."""
    return hashlib.sha256(json.dumps([str(what), fingerprint(what), list(tasks), horizon]).encode()).hexdigest()[:20]


class Scores:
    """A JSON file of scores by ``key``: what was scored once is not scored again."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}

    def get(self, k: str) -> dict[str, Any] | None:
        return self.data.get(k)

    def put(self, k: str, value: dict[str, Any]) -> None:
        self.data[k] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)

    def score(self, folder: str | Path, tasks: list[int], horizon: int, label: str = "") -> dict[str, Any]:
        """``score(folder, ...)``, from the cache where it is there."""
        k = key(folder, tasks, horizon)
        done = self.get(k)
        if done is not None:
            return done
        print(f"[evaluator] scoring {label or folder} on {len(tasks)} held-out tasks (greedy, horizon {horizon})",
              flush=True)
        out = {**score(folder, tasks, horizon), "what": str(folder), "label": label}
        print(f"[evaluator] {label or folder}: {out['success']:.3f} ({out['seconds']:.0f} s)", flush=True)
        self.put(k, out)
        return out


def ours_stage_checkpoints(tracking_uri: str, parent_run_id: str, stages: int) -> list[str]:
    """The checkpoint URI each of ours' stages ended with, as its in-run held-out evaluation
    recorded it (the pipeline's ``heldout/stage-<k>.json`` artifact, field ``model``)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    out = []
    for k in range(stages):
        path = client.download_artifacts(parent_run_id, f"heldout/stage-{k}.json")
        out.append(json.loads(Path(path).read_text())["model"])
    return out


def local_folder(ref: str, tracking_uri: str) -> Path:
    """An HF folder for a checkpoint URI (``agentgym.registry.champion.materialize``: the same
    lookup the pipeline's held-out evaluation makes)."""
    from agentgym.registry.champion import materialize

    return materialize(ref, tracking_uri)
