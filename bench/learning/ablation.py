"""ScalingInter-RL ablation: a growing horizon against a fixed short and a fixed long one.

One command per run; every run of an environment starts from the same SFT warm start (same
demonstrations, settings and seed: the SFT stage is deterministic), makes the same number of RL
iterations with the same episodes per iteration, and differs only in the horizon schedule and
the RL seed:

    .venv/bin/python bench/learning/ablation.py run --env babyai --schedule scaling --seed 0
    .venv/bin/python bench/learning/ablation.py run --env babyai --schedule short --seed 0
    .venv/bin/python bench/learning/ablation.py run --env babyai --schedule long --seed 0
    ...  (--seed 1 for BabyAI's second seed; --env textcraft for TextCraft)
    .venv/bin/python bench/learning/ablation.py report          # table + plots from MLflow

The run id is fixed by (env, schedule, seed), so re-running a killed command resumes it. Runs use
``configs/ablation/<env>.yaml``; ``--iterations`` scales the budget (default: the config's).
``report`` reads every finished run from MLflow (``sqlite:///mlflow-ablation.db``) and writes
``docs/results/ablation-<env>.png`` (held-out success against environment steps and wall time,
train reward, turns per episode, format errors) and a Markdown table to stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRACKING = "sqlite:///mlflow-ablation.db"
#: horizon schedules with the same total iterations (``n`` is divisible by 3)
SCHEDULES = {
    "scaling": lambda h, n: [{"horizon": h[0], "iterations": n // 3}, {"horizon": h[1], "iterations": n // 3},
                             {"horizon": h[2], "iterations": n - 2 * (n // 3)}],
    "short": lambda h, n: [{"horizon": h[0], "iterations": n}],
    "long": lambda h, n: [{"horizon": h[2], "iterations": n}],
}
HORIZONS = {"babyai": (5, 10, 20), "textcraft": (5, 10, 20)}


def run_id(env: str, schedule: str, seed: int) -> str:
    return f"ablation-{env}-{schedule}-s{seed}"


def overrides(env: str, schedule: str, seed: int, iterations: int) -> list[str]:
    stages = SCHEDULES[schedule](HORIZONS[env], iterations)
    return [f"schedule.stages={json.dumps(stages)}", f"seed={seed}", f"tracking.tracking_uri={TRACKING}",
            f"tracking.experiment=agentgym-ablation-{env}", f"heldout.horizon={HORIZONS[env][2]}"]


def cmd_run(args: argparse.Namespace) -> int:
    cfg = ROOT / "configs" / "ablation" / f"{args.env}.yaml"
    sets = overrides(args.env, args.schedule, args.seed, args.iterations)
    cmd = [str(Path(sys.executable).parent / "agentgym"), "train", "-c", str(cfg),
           "--run-id", run_id(args.env, args.schedule, args.seed)]
    for s in sets + list(args.set or []):
        cmd += ["--set", s]
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT)


def _runs(client, env: str) -> list[dict]:
    exp = client.get_experiment_by_name(f"agentgym-ablation-{env}")
    if exp is None:
        return []
    out = []
    for r in client.search_runs([exp.experiment_id], filter_string="tags.`agentgym.kind` = 'pipeline'"):
        rid = r.data.tags["agentgym.run_id"]
        parts = rid.split("-")
        out.append({"run": r, "run_id": rid, "schedule": parts[2], "seed": int(parts[3][1:])})
    return out


def cmd_report(args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=TRACKING)
    out_dir = ROOT / "docs" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    for env in HORIZONS:
        runs = _runs(client, env)
        if not runs:
            continue
        print(f"\n### {env}\n\n| schedule | seeds | random-valid | base | SFT | after RL | env steps | wall min |")
        print("|---|---|---|---|---|---|---|---|")
        fig, axes = plt.subplots(1, 4, figsize=(20, 4))
        for schedule in SCHEDULES:
            mine = [r for r in runs if r["schedule"] == schedule]
            if not mine:
                continue
            cells: dict[str, list[float]] = {}
            steps, walls = [], []
            for r in mine:
                rid = r["run"].info.run_id
                m = r["run"].data.metrics
                for label in ("random-valid", "base", "sft"):
                    key = f"heldout/{label}/overall/" + ("avg_at_1" if label == "random-valid" else "greedy_at_1")
                    if key in m:
                        cells.setdefault(label, []).append(m[key])
                last = sorted(k for k in m if k.startswith("heldout/stage-") and k.endswith("/overall/greedy_at_1"))
                if last:
                    cells.setdefault("rl", []).append(m[last[-1]])
                hist = {k: sorted(client.get_metric_history(rid, k), key=lambda x: x.step)
                        for k in ("reward_mean", "turns_per_episode", "format_error_rate", "episodes")}
                turns = [x.value for x in hist["turns_per_episode"]]
                eps = [x.value for x in hist["episodes"]]
                env_steps = np.cumsum([t * e for t, e in zip(turns, eps)])
                steps.append(env_steps[-1] if len(env_steps) else 0)
                walls.append((r["run"].info.end_time - r["run"].info.start_time) / 60000 if r["run"].info.end_time else float("nan"))
                lab = f"{schedule} s{r['seed']}"
                axes[0].plot(env_steps, [x.value for x in hist["reward_mean"]], label=lab)
                axes[1].plot([x.step for x in hist["turns_per_episode"]], turns, label=lab)
                axes[2].plot([x.step for x in hist["format_error_rate"]], [x.value for x in hist["format_error_rate"]], label=lab)
                if last:
                    axes[3].scatter([env_steps[-1] if len(env_steps) else 0], [m[last[-1]]], label=lab)

            def fmt(xs: list[float]) -> str:
                return "-" if not xs else f"{np.mean(xs):.3f}" + (f" ± {np.std(xs):.3f}" if len(xs) > 1 else "")

            print(f"| {schedule} | {len(mine)} | {fmt(cells.get('random-valid', []))} | {fmt(cells.get('base', []))} | "
                  f"{fmt(cells.get('sft', []))} | {fmt(cells.get('rl', []))} | {np.mean(steps):.0f} | {np.nanmean(walls):.1f} |")
        for ax, title in zip(axes, ("train reward vs env steps", "turns per episode vs iteration",
                                    "format-error rate vs iteration", "held-out success vs env steps")):
            ax.set_title(title)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / f"ablation-{env}.png", dpi=90)
        print(f"\n![{env}](results/ablation-{env}.png)")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one ablation run (resumes when re-run)")
    r.add_argument("--env", choices=sorted(HORIZONS), required=True)
    r.add_argument("--schedule", choices=sorted(SCHEDULES), required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--iterations", type=int, default=12, help="RL iterations in all (divisible by 3)")
    r.add_argument("--set", action="append", help="extra override, as agentgym train --set")
    sub.add_parser("report", help="table and plots of the finished runs")
    args = p.parse_args()
    return cmd_run(args) if args.cmd == "run" else cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
