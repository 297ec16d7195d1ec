"""Committed records of the ablation's finished runs, so that a report outlives the machine.

A run's MLflow database (``mlflow-ablation.db``) and checkpoints stay on the machine that made
them, and a working session here starts from a fresh clone: without a record in the repository a
seed run in one session could not be compared with a seed run in the next. ``report`` therefore
writes what it needs of every finished run to ``docs/results/ablation-runs/<env>.json`` and
renders its tables and plots from that file: per run the schedule, variant and seed, its learning
curve (per iteration: cumulative environment steps, minutes, train reward, turns per episode,
format-error and invalid-action rates; held-out success at each stage's end) and the greedy
success on every held-out task after its last stage (what the paired intervals need).

Runs of one environment are only comparable when they start from the same weights: every record
carries the fingerprint of its start (the SHA-256 of the warm start's weight files, or the base
model's name), and ``comparable`` keeps only the runs that share the current start's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

#: bump when the record layout changes incompatibly
VERSION = 1


def records_path(root: Path, env: str) -> Path:
    return root / "docs" / "results" / "ablation-runs" / f"{env}.json"


def load_records(root: Path, env: str) -> dict[str, Any]:
    """The committed records of ``env`` (empty when none were written yet)."""
    path = records_path(root, env)
    if not path.exists():
        return {"version": VERSION, "env": env, "start": None, "runs": {}}
    data = json.loads(path.read_text())
    if data.get("version") != VERSION:
        raise ValueError(f"{path}: record version {data.get('version')!r}, this script reads {VERSION}; "
                         "re-run the runs or convert the file")
    return data


def save_records(root: Path, env: str, data: dict[str, Any]) -> Path:
    path = records_path(root, env)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def merge(old: dict[str, Any], start: dict[str, Any] | None, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``old`` with the start and the runs found now replacing those of the same run id; runs
    recorded earlier and no longer in MLflow (an earlier machine's) are kept."""
    return {"version": VERSION, "env": old["env"], "start": start if start is not None else old["start"],
            "runs": {**old["runs"], **runs}}


def comparable(data: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The runs that started from the current start (by fingerprint), and the ids of the others."""
    start = (data.get("start") or {}).get("fingerprint")
    keep = {rid: r for rid, r in data["runs"].items() if start is None or r.get("start") == start}
    return keep, sorted(set(data["runs"]) - set(keep))


def weights_fingerprint(folder: Path) -> str:
    """SHA-256 over a checkpoint folder's weight files (``*.safetensors``, ``*.bin``), in name order."""
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors or *.bin weight files to fingerprint")
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return "sha256:" + h.hexdigest()
