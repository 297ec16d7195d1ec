"""Pipeline overhead: the share of an iteration's wall time outside generation, forward and backward.

    nice -n 19 .venv/bin/python bench/pipeline_overhead.py                  # quickstart, tiny model, ~2 min
    nice -n 19 .venv/bin/python bench/pipeline_overhead.py --model smollm2  # the quickstart's own model
    nice -n 19 .venv/bin/python bench/pipeline_overhead.py --iterations 4   # 2 stages x 4 iterations
    nice -n 19 .venv/bin/python bench/pipeline_overhead.py --model smollm2 \
        --config configs/ablation/textcraft.yaml --horizons 20 --iterations 3   # the learning issue's h20 scale

Issue #10 item 3, target <= 5 % at quickstart scale. Runs the real ScalingInter-RL flow
(``flows.train.scaling_inter_rl``: Prefect on a temporary local server, MLflow on a temporary
SQLite file, the trajectory store on a temporary folder) with ``configs/quickstart.yaml``'s (or ``--config``'s) RL
part (BabyAI, 2 tasks x group 4, GRPO, constrained actions, two stages of horizon 3 and 5),
SFT and the held-out table off, the tiny model by default.

Per-iteration wall time: the gaps between the MLflow timestamps of consecutive iterations'
metrics (logged at each iteration's end), the first iteration left out (it loads the model and
builds the trainer). A gap spans everything in between: the three Prefect tasks, MLflow
logging, and at a stage's end its checkpoint, summary and the next stage's subflow start.
Inside it, the timers the pipeline logs as metrics (``time/*``, ``agentgym/pipeline.py``):

* compute  -- generation (``time/generate_s``: inside ``engine.generate`` / ``choose``) and
  forward + backward + optimizer step (``time/train_s - time/train_store_read_s``);
* overhead -- the rollout loop and the environment steps, store writes and reads, advantages,
  trainer start-up, weight sync, and the rest (Prefect + MLflow + checkpoints + anything else).

Overhead share = (wall - compute) / wall, summed over the measured iterations.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PARTS = [  # (label, metric keys added up; "-" before a key subtracts it)
    ("generation", ["time/generate_s"]),
    ("forward/backward/step", ["time/train_s", "-time/train_store_read_s"]),
    ("rollout loop + env steps", ["time/rollout_loop_env_s"]),
    ("store writes", ["time/rollout_store_write_s", "time/rollout_store_commit_s", "time/advantages_store_write_s",
                      "time/train_batch_write_s"]),
    ("store reads", ["time/advantages_store_read_s", "time/update_store_read_s", "time/train_store_read_s"]),
    ("advantages", ["time/advantages_compute_s"]),
    ("trainer start-up", ["time/trainer_start_s"]),
    ("weight sync", ["time/weight_sync_s"]),
]
COMPUTE = ("generation", "forward/backward/step")


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny or smollm2 (the quickstart's)")
    ap.add_argument("--iterations", type=int, default=3, help="iterations per stage (quickstart: 2)")
    ap.add_argument("--config", default="configs/quickstart.yaml", help="the config whose RL part runs "
                    "(SFT and the held-out table off)")
    ap.add_argument("--horizons", type=int, nargs="+", default=[3, 5], help="one stage per horizon "
                    "(quickstart: 3 5)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                    help="a config override after the bench's own, as `agentgym train --set` (repeatable), "
                    "e.g. rollout.engine=vllm (run from .venv-vllm)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: on a shared 2-core machine a "
                    "second OpenMP thread spin-waits on a busy core, many times slower; see bench/README.md)")
    ap.add_argument("--quick", action="store_true", help="keyword env, 2 stages x 2 iterations (smoke)")
    ap.add_argument("--tag", default="", help="the record's name: bench/results/pipeline_overhead-<tag>.json "
                    "(default: the UTC time; --quick: smoke)")
    return ap.parse_args()


ARGS = _parse()
# a kept PREFECT_HOME: the temporary server's database is migrated once, not on every run (on a
# loaded 2-core machine a fresh one missed a 120 s start-up deadline)
os.environ.setdefault("PREFECT_HOME", os.path.expanduser("~/.cache/agentgym/bench-prefect"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "CRITICAL")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "600")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", str(ARGS.threads))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> int:
    import torch
    from mlflow.tracking import MlflowClient

    import benchlib
    from agentgym.config import load_config
    from benchlib import Row

    torch.set_num_threads(ARGS.threads)
    run = benchlib.start("pipeline_overhead", ARGS)
    tmp = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    it = ARGS.iterations
    sets = [f"model.name_or_path={ARGS.model}", "sft.enabled=false", "heldout.enabled=false",
            f"store.root={tmp / 'store'}", f"tracking.tracking_uri=sqlite:///{tmp}/mlflow.db",
            "tracking.experiment=bench-pipeline-overhead", "tracking.log_model=false",
            "schedule.stages=[" + ", ".join(f"{{horizon: {h}, iterations: {it}}}" for h in ARGS.horizons) + "]"]
    if ARGS.model == "tiny":  # the tiny model has 2 layers: train them all, in fp32
        sets += ["trainer.train_layers=null", "model.dtype=float32"]
    if ARGS.quick:
        sets += ["envs=[{name: keyword, tasks: [0, 1, 2, 3], kwargs: {target: 'yes', mode: starts_with}}]",
                 "rollout.constrain_actions=false", "schedule.stages=[{horizon: 1, iterations: 2}, {horizon: 2, iterations: 2}]"]
    sets += ARGS.overrides
    cfg = load_config(ROOT / ARGS.config, sets)

    from flows.train import scaling_inter_rl

    t0 = time.perf_counter()
    result = scaling_inter_rl(cfg)
    total_s = time.perf_counter() - t0
    client = MlflowClient(cfg.tracking.tracking_uri)
    parent = result["mlflow_run_id"]
    stamps = {m.step: m.timestamp / 1000 for m in client.get_metric_history(parent, "reward_mean")}
    steps = sorted(stamps)
    values: dict[str, dict[int, float]] = {}
    for _, keys in PARTS:
        for k in keys:
            k = k.lstrip("-")
            values[k] = {m.step: m.value for m in client.get_metric_history(parent, k)}
    measured = steps[1:]
    wall = {s: stamps[s] - stamps[prev] for prev, s in zip(steps, steps[1:])}
    parts = {}
    for label, keys in PARTS:
        parts[label] = sum((-1 if k.startswith("-") else 1) * values[k.lstrip("-")].get(s, 0.0)
                           for k in keys for s in measured)
    wall_s = sum(wall.values())
    parts["Prefect + MLflow + checkpoints + other"] = wall_s - sum(parts.values())
    compute = sum(parts[k] for k in COMPUTE)
    overhead = wall_s - compute
    print(f"\npipeline_overhead: {ARGS.model}, {len(steps)} iterations ({len(measured)} measured), "
          f"flow wall {total_s:.1f} s")
    print(f"{'part':<40} {'s':>8} {'share':>7}")
    for label, s in parts.items():
        print(f"{label:<40} {s:>8.2f} {s / wall_s:>7.1%}")
    print(f"{'iterations wall (measured)':<40} {wall_s:>8.2f}")
    print(f"{'mean iteration wall':<40} {wall_s / max(1, len(measured)):>8.2f}")
    rows = [Row("overhead share of iteration wall", overhead, wall_s, target=("<=", 0.05), unit="s")]
    benchlib.print_table(rows, "overhead = wall - generation - forward/backward/step")
    repeats = [{"step": s, "measured": s in wall, "wall_s": wall.get(s), **{k: v.get(s) for k, v in values.items()}}
               for s in steps]  # every iteration, the first (not measured) too
    benchlib.write_results(run, rows, repeats, {"parts_s": parts, "wall_s": wall_s, "flow_total_s": total_s,
                                                "overrides": sets})
    return 0


if __name__ == "__main__":
    sys.exit(main())
