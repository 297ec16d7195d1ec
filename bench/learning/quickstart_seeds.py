"""The quickstart's held-out table over seeds, each seed a committed record.

    .venv/bin/python bench/learning/quickstart_seeds.py run --seed 0      # its minutes: the record's wall_min
    .venv/bin/python bench/learning/quickstart_seeds.py run --seed 1      # and 2
    .venv/bin/python bench/learning/quickstart_seeds.py report            # the table, over the seeds recorded

``run`` is ``agentgym train -c configs/quickstart.yaml --set seed=N`` as shipped (its four
ScalingInter-RL stages and its held-out table after every stage), tracked in
``sqlite:///mlflow-quickstart.db`` under run id ``quickstart-s<N>`` (re-running resumes it), then
reads the run's held-out artifacts back from MLflow and writes
``docs/results/quickstart/quickstart-s<N>.json`` (``results_io``: command, commit, machine, load):
per policy (random valid action, base model, the policy after each stage) the task ids and each
task's greedy success (the random row: its success rate over ``heldout.random_seeds`` seeds), the
run's minutes and the training success of every iteration. ``report`` prints per seed and the
mean over seeds with a 95 % bootstrap interval over tasks and seeds (``bootstrap.mean_interval``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bootstrap.py beside this script
sys.path.insert(1, str(ROOT / "bench"))  # results_io.py
import results_io  # noqa: E402
from bootstrap import mean_interval  # noqa: E402

CONFIG = ROOT / "configs" / "quickstart.yaml"
TRACKING = "sqlite:///mlflow-quickstart.db"
EXPERIMENT = "agentgym-quickstart-seeds"
RECORDS = ROOT / "docs" / "results" / "quickstart"
RANDOM = "random-valid"  # agentgym.evaluation.heldout_metrics.RANDOM


def run_id(seed: int) -> str:
    return f"quickstart-s{seed}"


def record_path(seed: int, folder: Path = RECORDS) -> Path:
    return folder / f"quickstart-s{seed}.json"


def per_task(report: dict[str, Any]) -> dict[str, list[float]]:
    """``EvalReport.to_dict()`` -> ``{"tasks": [...], "success": [...]}``, each task's success rate
    (one greedy episode: 0 or 1; the random row: the mean over its seeds)."""
    rows = sorted(report["tasks"], key=lambda t: (t["env"], int(t["task_id"])))
    return {"tasks": [int(t["task_id"]) for t in rows],
            "success": [t["successes"] / t["n"] if t["n"] else float("nan") for t in rows]}


def policy_rows(artifacts: dict[str, dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """The held-out artifacts of a run (``heldout/<label>.json`` by label) -> per policy its tasks
    and successes: the random row from its sampled report, every other from its greedy one; in
    the order random, base, stage-0, stage-1, ..."""
    order = [RANDOM, "base"] + sorted((k for k in artifacts if k.startswith("stage-")),
                                      key=lambda k: int(k.split("-")[1]))
    return {label: per_task(artifacts[label]["sampled" if label == RANDOM else "greedy"])
            for label in order if label in artifacts}


def _pipeline_run(client, rid: str):
    exp = client.get_experiment_by_name(EXPERIMENT)
    if exp is None:
        return None
    found = client.search_runs([exp.experiment_id], filter_string=f"tags.`agentgym.run_id` = '{rid}' and "
                               "tags.`agentgym.kind` = 'pipeline'")
    return found[0] if found else None


def cmd_run(args: argparse.Namespace) -> int:
    from mlflow.tracking import MlflowClient

    from agentgym.tracking.metric_history import metric_history

    rid = run_id(args.seed)
    sets = [f"seed={args.seed}", f"tracking.tracking_uri={TRACKING}", f"tracking.experiment={EXPERIMENT}"]
    cmd = [str(Path(sys.executable).parent / "agentgym"), "train", "-c", str(CONFIG), "--run-id", rid]
    for s in sets:
        cmd += ["--set", s]
    record = results_io.Run("quickstart_seeds", {"config": "configs/quickstart.yaml", "seed": args.seed,
                                                 "run_id": rid, "overrides": sets})
    print(" ".join(cmd), flush=True)
    rc = subprocess.call(cmd, cwd=ROOT)
    if rc != 0:
        return rc
    client = MlflowClient(tracking_uri=TRACKING)
    run = _pipeline_run(client, rid)
    if run is None or run.info.status != "FINISHED":
        print(f"note: no finished MLflow run {rid}: no record written", file=sys.stderr)
        return 1
    artifacts: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for f in client.list_artifacts(run.info.run_id, "heldout"):
            if f.path.endswith(".json"):
                got = client.download_artifacts(run.info.run_id, f.path, tmp)
                artifacts[Path(f.path).stem] = json.loads(Path(got).read_text())
    rows = policy_rows(artifacts)
    results = {"seed": args.seed, "run_id": rid, "mlflow_run_id": run.info.run_id, "policies": rows,
               "success": {k: float(np.mean(v["success"])) for k, v in rows.items()},
               "train_success": [m.value for m in metric_history(client, run.info.run_id, "success_rate")],
               "wall_min": ((run.info.end_time or 0) - run.info.start_time) / 60000}
    out = record.write([], results, tag=f"s{args.seed}", out=record_path(args.seed))
    print(json.dumps(results["success"], indent=1))
    print(f"record: {out.relative_to(ROOT)}")
    return 0


def report_markdown(records: list[dict[str, Any]]) -> str:
    """Per policy: each seed's held-out success, and the mean over seeds with its 95 % bootstrap
    interval over tasks and seeds; then each run's minutes."""
    records = sorted(records, key=lambda r: r["seed"])
    seeds = [r["seed"] for r in records]
    labels = list(records[0]["policies"])
    lines = ["| policy (held-out, greedy) | " + " | ".join(f"seed {s}" for s in seeds) + " | mean [95 % interval] |",
             "|---|" + "---:|" * (len(seeds) + 1)]
    for label in labels:
        rows = [r["policies"][label] for r in records if label in r["policies"]]
        if len(rows) != len(records) or any(row["tasks"] != rows[0]["tasks"] for row in rows):
            raise ValueError(f"{label}: the seeds' records hold different held-out tasks; re-run them with one config")
        m, lo, hi = mean_interval(np.array([row["success"] for row in rows]))
        lines.append(f"| {label} | " + " | ".join(f"{np.mean(row['success']):.3f}" for row in rows)
                     + f" | {m:.3f} [{lo:.3f}, {hi:.3f}] |")
    lines.append("| minutes (the run, held-out evaluations included) | "
                 + " | ".join(f"{r['wall_min']:.1f}" for r in records) + " | |")
    return "\n".join(lines)


def load_records(folder: Path = RECORDS) -> list[dict[str, Any]]:
    return [json.loads(p.read_text())["results"] for p in sorted(folder.glob("quickstart-s*.json"))]


def cmd_report(args: argparse.Namespace) -> int:
    records = load_records()
    if not records:
        print(f"no records in {RECORDS.relative_to(ROOT)}: run `quickstart_seeds.py run --seed 0` first",
              file=sys.stderr)
        return 2
    print(report_markdown(records))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train the quickstart with one seed and write its record (resumes when re-run)")
    r.add_argument("--seed", type=int, required=True)
    sub.add_parser("report", help="the table over the seeds recorded")
    args = p.parse_args()
    return {"run": cmd_run, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
