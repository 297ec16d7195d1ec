"""ScalingInter-RL ablation: a growing horizon against a fixed short and a fixed long one.

Every RL run of an environment starts from **one** SFT warm start (trained once by ``warmstart``),
makes the same number of RL iterations with the same tasks per iteration, and differs only in
the horizon schedule and the RL seed:

    .venv/bin/python bench/learning/ablation.py warmstart --env babyai   # demos, SFT, held-out rows
    .venv/bin/python bench/learning/ablation.py run --env babyai --schedule scaling --seed 0
    .venv/bin/python bench/learning/ablation.py run --env babyai --schedule short --seed 0
    .venv/bin/python bench/learning/ablation.py run --env babyai --schedule long --seed 0
    ...  (--seed 1 for a second seed; --env textcraft for TextCraft)
    .venv/bin/python bench/learning/ablation.py run --env babyai-base --schedule scaling --seed 0 --variant gigpo
    .venv/bin/python bench/learning/ablation.py report          # table + plots from MLflow

``--variant gigpo|turn`` runs a schedule with turn-level credit instead of outcome-only GRPO,
``--variant async`` with asynchronous RL (``rollout.async_steps: 1``) instead of synchronous,
``--variant renorm`` with the constrained replies' log-probs renormalised over the valid actions
(``rollout.action_logprob: renormalised``, for the configs with ``rollout.constrain_actions``)
instead of the policy's own (``VARIANTS``); each is its own run and row, compared with its
schedule in the report.

``--env babyai-base`` is the same comparison from the base model, without a warm start (the
paper's setting), on ``configs/quickstart.yaml`` itself (its tasks and RL settings): its runs
need no ``warmstart`` and each measures its own random-valid and base rows. ``--env babyai-hard``
(levels with several rooms, doors and keys; horizons 3 -> 6 -> 9) and ``--env textcraft-base``
(recipes of depth 2-3 with the inventory shown; 5 -> 10 -> 20) are the same from-base comparison
where the horizon matters more (``configs/ablation/<env>.yaml`` say why). ``--env
babyai-hard-warm`` and ``--env textcraft-warm`` are babyai-hard and textcraft-base from one SFT
warm start each (``warmstart --env <env>`` first; ``WARM_SFT``).

Run ids are fixed by (env, schedule, seed), so re-running a killed command resumes it. Runs use
``config_path(env)``: ``configs/ablation/<env>.yaml``, or the quickstart's for babyai-base. The warm start is an ``agentgym train`` run with one RL
iteration (the pipeline has no zero-iteration stage); its held-out table gives the random-valid,
base and after-SFT rows at the ablation's held-out horizon, and its SFT checkpoint is the
``model.name_or_path`` of every RL run (which then skips SFT and the base evaluation).
``report`` adds what MLflow (``sqlite:///mlflow-ablation.db``) holds of the finished runs to the
committed records ``docs/results/ablation-runs/<env>.json`` (``run_records.py``: runs made on an
earlier machine stay in them), and from those writes ``docs/results/ablation-<env>.png``
(held-out success against environment steps and against minutes of running, which leave out the
pause of a run resumed in a later session; train reward, turns per episode, format errors and
invalid actions) and Markdown tables to stdout: per schedule the final held-out success per seed,
and 95 % bootstrap intervals of each schedule's mean and of ScalingInter-RL minus each fixed
schedule, paired on the held-out tasks (``bootstrap.py``).

Each finished ``run`` also writes its own record, ``bench/results/ablation-<env>-<schedule>[_<variant>]-s<seed>.json``
(``results_io``: the command's config, commit, machine and load; every iteration's metrics; the held-out
points and per-task successes), whose commit, machine and load ``report`` copies into the run's entry.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bootstrap.py beside this script
sys.path.insert(1, str(ROOT / "bench"))  # results_io.py
import results_io  # noqa: E402
from agentgym.evaluation.heldout_metrics import RANDOM, policy_metric  # noqa: E402
TRACKING = "sqlite:///mlflow-ablation.db"
#: horizon schedules with the same total iterations (``n`` is divisible by 3)
SCHEDULES = {
    "scaling": lambda h, n: [{"horizon": h[0], "iterations": n // 3}, {"horizon": h[1], "iterations": n // 3},
                             {"horizon": h[2], "iterations": n - 2 * (n // 3)}],
    "short": lambda h, n: [{"horizon": h[0], "iterations": n}],
    "long": lambda h, n: [{"horizon": h[2], "iterations": n}],
}
#: (short, middle, long) horizons; held-out episodes get the long one
HORIZONS = {"babyai": (3, 6, 12), "textcraft": (5, 10, 20), "babyai-base": (2, 3, 5), "babyai-hard": (3, 6, 9),
            "textcraft-base": (5, 10, 20), "babyai-hard-warm": (3, 6, 9), "textcraft-warm": (5, 10, 20)}
#: held-out evaluation after every stage (True) or after the run's last stage only: a TextCraft
#: evaluation is 30 tasks x up to 20 turns (6-8 min here), three of them would double a run
EVERY_STAGE = {"babyai": True, "textcraft": False, "babyai-base": True, "babyai-hard": True, "textcraft-base": True,
               "babyai-hard-warm": True, "textcraft-warm": True}
#: RL from the base model itself: no warm start, every run evaluates the base model too
FROM_BASE = {"babyai-base": "smollm2", "babyai-hard": "smollm2", "textcraft-base": "smollm2"}
#: environments whose runs use a shipped config instead of configs/ablation/<env>.yaml
CONFIGS = {"babyai-base": "configs/quickstart.yaml", "babyai-hard-warm": "configs/ablation/babyai-hard.yaml",
           "textcraft-warm": "configs/ablation/textcraft-base.yaml"}
#: the warm start's SFT settings where the config has none of its own: babyai-hard-warm is the
#: babyai-hard comparison from one warm start (the babyai ablation's SFT recipe, 64 expert
#: demonstrations of at most 20 turns, 2 epochs). The scripted expert solves about a fifth of the
#: hard levels' attempts (53 of 256), so it gets 8 attempts per demonstration instead of 4.
WARM_SFT = {"babyai-hard-warm": ["sft.episodes=64", "sft.heldout_episodes=8", "sft.epochs=2",
                                 "sft.batch_size=4", "sft.learning_rate=3e-4",
                                 "sft.attempts_per_episode=8"],
            # textcraft-warm is textcraft-base from one warm start: the TextCraft ablation's SFT
            # recipe (96 expert demonstrations of at most 30 turns, 3 epochs at 3e-4)
            "textcraft-warm": ["sft.episodes=96", "sft.heldout_episodes=16", "sft.horizon=30", "sft.epochs=3",
                               "sft.batch_size=8", "sft.learning_rate=3e-4"]}
ITERATIONS = 6
#: default RL iterations of a run, per environment (divisible by 3)
DEFAULT_ITERATIONS = {"babyai-base": 51, "babyai-hard": 51, "textcraft-base": 51, "babyai-hard-warm": 51,
                      "textcraft-warm": 51}
#: held-out tasks replacing the config's ``envs.0.eval_tasks`` (None: the config's own). For
#: babyai-base: the quickstart's 7 GoTo levels at minigrid seeds 100-109, the first 64 (the
#: quickstart's 32 held-out tasks are the first 32 of them); training uses seeds 0-5.
EVAL_TASKS = {"babyai-base": [40 * seed + level for seed in range(100, 110) for level in (0, 1, 2, 4, 8, 9, 10)][:64]}


#: variants of a schedule (``run --variant``), each its own run and row against the plain one:
#: turn-level credit against the default outcome-only GRPO (gigpo: GiGPO's step groups by
#: environment state, ``turn_baseline: state``, its turn_gamma 0.95; turn: the same-turn-index
#: baseline), async: asynchronous RL, the next rollout played during each update with the
#: weights one update older (``rollout.async_steps: 1``), against the synchronous default, and
#: renorm: the PPO ratio of a constrained reply taken on its log-prob renormalised over the turn's
#: valid actions (``rollout.action_logprob: renormalised``) against the policy's own log-prob.
VARIANTS: dict[str, list[str]] = {
    "gigpo": ["algorithm.credit=turn", "algorithm.turn_baseline=state", "algorithm.turn_gamma=0.95"],
    "turn": ["algorithm.credit=turn", "algorithm.turn_baseline=turn"],
    "async": ["rollout.async_steps=1"],
    "renorm": ["rollout.action_logprob=renormalised"],
}
#: which config section a variant changes (everything else stays the plain run's)
VARIANT_SECTION = {"gigpo": "algorithm", "turn": "algorithm", "async": "rollout", "renorm": "rollout"}


def config_path(env: str) -> Path:
    """The config an environment's runs start from (its schedule is replaced per run)."""
    return ROOT / CONFIGS.get(env, f"configs/ablation/{env}.yaml")


def tracking_uri() -> str:
    """``TRACKING`` with its database path made absolute (the runs use it from the repository root)."""
    path = Path(TRACKING.removeprefix("sqlite:///"))
    return f"sqlite:///{path if path.is_absolute() else ROOT / path}"


def run_id(env: str, schedule: str, seed: int, variant: str = "") -> str:
    return f"ablation-{env}-{schedule}{'_' + variant if variant else ''}-s{seed}"


def arm(schedule: str, variant: str = "") -> str:
    """An arm's label in the report: the schedule, and its credit variant if any."""
    return f"{schedule} + {variant}" if variant else schedule


def warmstart_id(env: str) -> str:
    return f"ablation-{env}-warmstart"


def _common(env: str) -> list[str]:
    sets = [f"tracking.tracking_uri={TRACKING}", f"tracking.experiment=agentgym-ablation-{env}",
            f"heldout.horizon={HORIZONS[env][2]}", "heldout.enabled=true"]
    if env in EVAL_TASKS:
        sets.append(f"envs.0.eval_tasks={json.dumps(EVAL_TASKS[env])}")
    return sets


def warmstart_overrides(env: str) -> list[str]:
    """SFT, the random-valid / base / after-SFT evaluations, and the one RL iteration the pipeline
    needs (its stage is not part of the ablation)."""
    return _common(env) + WARM_SFT.get(env, []) + [
        "sft.enabled=true", "heldout.every_stage=false",
        'schedule.stages=[{"horizon": %d, "iterations": 1}]' % HORIZONS[env][0]]


def overrides(env: str, schedule: str, seed: int, iterations: int, warm_start: str) -> list[str]:
    """One RL run from the warm start ``warm_start`` (a local HF folder, or for ``FROM_BASE``
    environments the base model, which the run then evaluates as its base row)."""
    stages = SCHEDULES[schedule](HORIZONS[env], iterations)
    base = "true" if env in FROM_BASE else "false"
    return _common(env) + [f"schedule.stages={json.dumps(stages)}", f"seed={seed}",
                           f"model.name_or_path={warm_start}", "sft.enabled=false", f"heldout.base={base}",
                           f"heldout.every_stage={str(EVERY_STAGE[env]).lower()}"]


def _train(env: str, rid: str, sets: list[str]) -> int:
    cfg = config_path(env)
    cmd = [str(Path(sys.executable).parent / "agentgym"), "train", "-c", str(cfg), "--run-id", rid]
    for s in sets:
        cmd += ["--set", s]
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT)


def warm_start_folder(env: str) -> Path | None:
    """The local folder of the warm start's SFT checkpoint (None: ``warmstart`` has not finished)."""
    from agentgym.registry.champion import materialize
    from agentgym.tracking.tracker import Tracker

    tracker = Tracker(tracking_uri(), f"agentgym-ablation-{env}")
    found = tracker.find_run(warmstart_id(env), "sft")
    if found is None or not tracker.is_finished(found):
        return None
    uri = tracker.run_checkpoint(found)
    return materialize(uri, tracker.uri) if uri else None


def cmd_warmstart(args: argparse.Namespace) -> int:
    return _train(args.env, warmstart_id(args.env), warmstart_overrides(args.env) + list(args.set or []))


def cmd_run(args: argparse.Namespace) -> int:
    iterations = args.iterations or DEFAULT_ITERATIONS.get(args.env, ITERATIONS)
    folder = FROM_BASE.get(args.env) or warm_start_folder(args.env)
    if folder is None:
        print(f"no finished warm start for {args.env}: run first\n  .venv/bin/python bench/learning/ablation.py "
              f"warmstart --env {args.env}", file=sys.stderr)
        return 2
    sets = overrides(args.env, args.schedule, args.seed, iterations, str(folder)) + VARIANTS.get(args.variant or "", [])
    rid = run_id(args.env, args.schedule, args.seed, args.variant or "")
    record = results_io.Run("ablation", {**vars(args), "iterations": iterations, "run_id": rid,
                                         "overrides": sets + list(args.set or [])})
    rc = _train(args.env, rid, sets + list(args.set or []))
    if rc == 0:
        write_run_record(record, args.env, rid)
    return rc


def record_path(rid: str) -> Path:
    """A run's own record, ``bench/results/ablation-<env>-<schedule>[_<variant>]-s<seed>.json``."""
    return results_io.record_path("ablation", rid.removeprefix("ablation-"))


def write_run_record(record: "results_io.Run", env: str, rid: str) -> Path | None:
    """The finished run's record (``results_io``: config, commit, machine, load at start and end of
    this command, a resumed run's last part only): every iteration's metrics as ``repeats``, the
    held-out points and per-task successes as results. ``report`` copies its commit, machine and
    load into the run's entry of ``docs/results/ablation-runs/<env>.json``."""
    body = _record_body(env, rid)
    if body is None:
        return None
    path = record.write(*body, tag=rid.removeprefix("ablation-"))
    print(f"record: {path}")
    return path


def _record_body(env: str, rid: str) -> tuple[list[dict], dict] | None:
    """A finished run's ``repeats`` (every iteration's metrics) and ``results`` (held-out points,
    per-task successes, minutes in all) read from MLflow; None (said) when MLflow has no such run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri())
    found = [r for r in _runs(client, env)[0] if r["run_id"] == rid]
    if not found:
        print(f"note: no finished MLflow run {rid}: no record written", file=sys.stderr)
        return None
    r = found[0]
    c = _curve(client, r["run"], r["schedule"], HORIZONS[env])
    per_task = _final_successes(client, r["run"], r["schedule"], HORIZONS[env])
    repeats = [{"iteration": i + 1, "env_steps": float(c["steps"][i]), "minutes": float(c["minutes"][i]),
                "reward_mean": c["reward"][i], "turns_per_episode": c["turns"][i],
                "format_error_rate": c["format"][i], "invalid_action_rate": c["invalid"][i]}
               for i in range(len(c["turns"]))]
    return repeats, {"heldout": [{"env_steps": h[0], "minutes": h[1], "success": h[2]} for h in c["heldout"]],
                     "per_task": {str(k): v for k, v in per_task.items()} if per_task else None,
                     "wall_min": float(c["wall"]), "mlflow_run_id": r["run"].info.run_id}


def cmd_record(args: argparse.Namespace) -> int:
    """Rewrite a finished run's record from MLflow with today's reading of its history (e.g. after
    a fix to how a resumed run's redone steps are read), keeping the provenance of the command that
    ran it (started, command, config, commit, machine, load) and noting the rewrite's own date and
    commit under ``rerecorded``."""
    rid = run_id(args.env, args.schedule, args.seed, args.variant or "")
    path = record_path(rid)
    if not path.exists():
        print(f"no record {path.relative_to(ROOT)} to rewrite: `run` writes it when the run finishes", file=sys.stderr)
        return 2
    body = _record_body(args.env, rid)
    if body is None:
        return 2
    rec = json.loads(path.read_text())
    rec["repeats"], rec["results"] = body
    rec["rerecorded"] = {"date": results_io.utc_now(), "git": results_io.git_state()}
    path.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"record: {path}")
    return 0


def _provenance(rid: str) -> dict:
    """The commit, machine and load of ``rid``'s own record (``write_run_record``), if it has one."""
    path = record_path(rid)
    if not path.exists():
        return {}
    rec = json.loads(path.read_text())
    return {"record": path.name, "git": rec.get("git"), "machine": rec.get("machine"), "load": rec.get("load")}


def _runs(client, env: str) -> tuple[list[dict], object | None]:
    exp = client.get_experiment_by_name(f"agentgym-ablation-{env}")
    if exp is None:
        return [], None
    out, warm = [], None
    for r in client.search_runs([exp.experiment_id], filter_string="tags.`agentgym.kind` = 'pipeline'"):
        rid = r.data.tags["agentgym.run_id"]
        if rid == warmstart_id(env):
            warm = r
            continue
        parts = rid.removeprefix(f"ablation-{env}-").split("-")
        schedule, _, variant = parts[0].partition("_")
        if len(parts) == 2 and schedule in SCHEDULES and variant in ("", *VARIANTS) and r.info.status == "FINISHED":
            out.append({"run": r, "run_id": rid, "schedule": schedule, "variant": variant,
                        "seed": int(parts[1][1:])})
    return out, warm


def _curve(client, run, schedule: str, horizons: tuple[int, int, int]) -> dict:
    """Per-iteration train metrics, cumulative environment steps and minutes of running
    (``learning_curve.running_minutes``), and the held-out success at the end of each stage placed
    at that stage's last iteration."""
    import numpy as np

    from agentgym.evaluation.learning_curve import measured_seconds, running_minutes
    from agentgym.tracking.metric_history import metric_history

    rid = run.info.run_id
    hist = {k: metric_history(client, rid, k)
            for k in ("reward_mean", "turns_per_episode", "format_error_rate", "invalid_action_rate", "episodes")}
    turns = [x.value for x in hist["turns_per_episode"]]
    eps = [x.value for x in hist["episodes"]]
    steps = np.cumsum([t * e for t, e in zip(turns, eps)])
    stage_ends = np.cumsum([s["iterations"] for s in SCHEDULES[schedule](horizons, len(turns))]) - 1
    m = run.data.metrics
    expected, tail = measured_seconds(client, run, len(turns), [int(e) + 1 for e in stage_ends])
    minutes, wall = running_minutes(run.info.start_time, run.info.end_time,
                                    [x.timestamp for x in hist["reward_mean"]], expected, tail)
    held = []
    for i, end in enumerate(stage_ends):
        success = policy_metric(m, f"stage-{i}", "overall/greedy_at_1")
        if success is not None and end < len(steps):
            held.append((float(steps[end]), minutes[end], success))
    return {"steps": steps, "minutes": minutes, "turns": turns, "reward": [x.value for x in hist["reward_mean"]],
            "format": [x.value for x in hist["format_error_rate"]],
            "invalid": [x.value for x in hist["invalid_action_rate"]], "heldout": held, "wall": wall}


def _final_successes(client, run, schedule: str, horizons: tuple[int, int, int]) -> dict[int, float] | None:
    """Greedy success per held-out task after the run's last stage (its ``heldout/stage-<last>.json``)."""
    import tempfile

    last = len(SCHEDULES[schedule](horizons, ITERATIONS)) - 1
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = client.download_artifacts(run.info.run_id, f"heldout/stage-{last}.json", tmp)
        except Exception:  # noqa: BLE001 -- a run finished before per-task reports were logged
            return None
        report = json.loads(Path(path).read_text())
    return {t["task_id"]: t["successes"] / max(t["n"], 1) for t in report["greedy"]["tasks"]}


def _interval_rows(per_arm: dict[str, list[dict[int, float]]]) -> list[str]:
    """Markdown rows: each schedule's mean with its 95 % bootstrap interval, and ScalingInter-RL
    minus each fixed schedule and the long minus the short one, paired on the held-out tasks
    (``bootstrap.py``)."""
    import numpy as np
    from bootstrap import mean_interval, paired_difference

    arms = {k: v for k, v in per_arm.items() if v}
    if not arms:
        return []
    tasks = sorted(set.intersection(*(set(d) for runs in arms.values() for d in runs)))
    mats = {k: np.array([[d[t] for t in tasks] for d in runs]) for k, runs in arms.items()}
    rows = [f"\n95 % bootstrap intervals over the {len(tasks)} held-out tasks (paired across schedules) "
            "and the seeds (resampled per schedule):\n", "| | mean | 95 % interval |", "|---|---|---|"]
    for k, m in mats.items():
        mean, lo, hi = mean_interval(m)
        rows.append(f"| {k} ({m.shape[0]} seeds) | {mean:.3f} | [{lo:.3f}, {hi:.3f}] |")
    pairs = [("scaling", "short"), ("scaling", "long"), ("long", "short")] + [
        (k, k.split(" + ")[0]) for k in mats if " + " in k]  # a credit variant against its schedule
    for a, b in pairs:
        if a in mats and b in mats:
            diff, lo, hi = paired_difference(mats[a], mats[b])
            rows.append(f"| {a} − {b} | {diff:+.3f} | [{lo:+.3f}, {hi:+.3f}] |")
    return rows


def _collect(client, env: str, horizons: tuple[int, int, int]) -> tuple[dict | None, dict[str, dict], object | None]:
    """What MLflow holds of ``env`` now, as ``run_records``: the start (its fingerprint and the
    rows before RL), every finished run's record, and the warm start's MLflow run (None: none)."""
    from datetime import datetime, timezone

    from run_records import weights_fingerprint

    runs, warm = _runs(client, env)
    if not runs and warm is None:
        return None, {}, None
    # the rows before RL: the warm start's run, or (from the base model) any run's own
    wm = warm.data.metrics if warm is not None else runs[0]["run"].data.metrics
    if env in FROM_BASE:
        fingerprint = FROM_BASE[env]
    else:
        folder = warm_start_folder(env)
        if folder is None:  # the warm start is unfinished: its runs cannot be either
            return None, {}, warm
        fingerprint = weights_fingerprint(folder)
    start = {"fingerprint": fingerprint,
             "random_valid": policy_metric(wm, RANDOM, "overall/avg_at_1"),
             "base": policy_metric(wm, "base", "overall/greedy_at_1"),
             "after_sft": None if env in FROM_BASE else policy_metric(wm, "sft", "overall/greedy_at_1")}
    records = {}
    for r in runs:
        c = _curve(client, r["run"], r["schedule"], horizons)
        per_task = _final_successes(client, r["run"], r["schedule"], horizons)
        ended = r["run"].info.end_time or r["run"].info.start_time
        records[r["run_id"]] = {
            "schedule": r["schedule"], "variant": r["variant"], "seed": r["seed"], "start": fingerprint,
            "date": datetime.fromtimestamp(ended / 1000, timezone.utc).strftime("%Y-%m-%d"),
            "per_task": {str(k): v for k, v in per_task.items()} if per_task else None,
            "curve": {k: [float(x) for x in v] for k, v in c.items() if k not in ("heldout", "wall")}
            | {"heldout": [[float(x) for x in h] for h in c["heldout"]], "wall": float(c["wall"])},
            **_provenance(r["run_id"])}
    return start, records, warm


def cmd_report(args: argparse.Namespace) -> int:
    from mlflow.tracking import MlflowClient
    from run_records import load_records, merge, save_records

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar per held-out report
    client = MlflowClient(tracking_uri=tracking_uri())
    for env, horizons in HORIZONS.items():
        start, found, warm = _collect(client, env, horizons)
        old = load_records(ROOT, env)
        if start is None and not old["runs"]:
            continue
        data = merge(old, start, found)
        save_records(ROOT, env, data)
        if not data["runs"]:  # only the start so far: keep the figure an earlier machine's runs drew
            continue
        path = _render(env, horizons, data)
        if warm is not None:
            client.log_artifact(warm.info.run_id, str(path), "ablation")
    return 0


def _render(env: str, horizons: tuple[int, int, int], data: dict) -> Path:
    """Print ``env``'s tables and write its figure, from its run records (``run_records``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from run_records import comparable

    start = data["start"] or {}
    runs, others = comparable(data)
    sft, random_valid, base = (float("nan") if start.get(k) is None else start[k]
                               for k in ("base" if env in FROM_BASE else "after_sft", "random_valid", "base"))
    print(f"\n### {env} (held-out greedy success, horizon {horizons[2]})\n")
    print(f"random-valid (mean of seeds) {random_valid:.3f}, base {base:.3f}"
          + ("" if env in FROM_BASE else f", after SFT {sft:.3f}") + "\n")
    if others:
        print(f"Left out, recorded from another start than the current one: {', '.join(others)}\n")
    print("| schedule | horizons | seeds | after RL (mean ± sd) | per seed | env steps | min running |")
    print("|---|---|---|---|---|---|---|")
    fig, axes = plt.subplots(1, 5, figsize=(25, 4))
    for ax in axes[:2]:
        ax.axhline(sft, color="grey", ls="--", lw=1, label="base" if env in FROM_BASE else "after SFT")
        ax.axhline(random_valid, color="grey", ls=":", lw=1, label="random valid")
    per_arm: dict[str, list[dict[int, float]]] = {}
    for schedule, variant in [(s, v) for v in ("", *VARIANTS) for s in SCHEDULES]:
        mine = sorted((r for r in runs.values() if (r["schedule"], r["variant"]) == (schedule, variant)),
                      key=lambda r: r["seed"])
        if not mine:
            continue
        name = arm(schedule, variant)
        finals, steps, walls = [], [], []
        for r in mine:
            if r["per_task"]:
                per_arm.setdefault(name, []).append({int(k): v for k, v in r["per_task"].items()})
            c = r["curve"]
            lab = f"{name} s{r['seed']}"
            if c["heldout"]:
                finals.append(c["heldout"][-1][2])
                xs = [0.0] + [h[0] for h in c["heldout"]]
                ts = [0.0] + [h[1] for h in c["heldout"]]
                ys = [sft] + [h[2] for h in c["heldout"]]
                # a one-stage schedule is evaluated once, at its end: a point, not a line from the start
                one = len(c["heldout"]) == 1
                first, ls = (1, "none") if one else (0, "-")
                axes[0].plot(xs[first:], ys[first:], marker="o", ls=ls, label=lab)
                axes[1].plot(ts[first:], ys[first:], marker="o", ls=ls, label=lab)
            steps.append(c["steps"][-1] if c["steps"] else 0.0)
            walls.append(c["wall"])
            axes[2].plot(c["steps"], c["reward"], label=lab)
            axes[3].plot(range(1, len(c["turns"]) + 1), c["turns"], label=lab)
            line = axes[4].plot(range(1, len(c["format"]) + 1), c["format"], label=f"{lab} format")
            axes[4].plot(range(1, len(c["invalid"]) + 1), c["invalid"], ls="--", color=line[0].get_color(),
                         label=f"{lab} invalid action")
        sched = " → ".join(str(s["horizon"]) for s in SCHEDULES[schedule](horizons, ITERATIONS))
        spread = f"{np.mean(finals):.3f} ± {np.std(finals):.3f}" if len(finals) > 1 else \
            (f"{finals[0]:.3f}" if finals else "-")
        print(f"| {name} | {sched} | {len(mine)} | {spread} | {', '.join(f'{x:.3f}' for x in finals)} | "
              f"{np.mean(steps):.0f} | {np.nanmean(walls):.1f} |")
    print("\n".join(_interval_rows(per_arm)))
    titles = ("held-out success vs env steps", "held-out success vs minutes running",
              "train reward vs env steps", "turns per episode vs iteration",
              "format-error / invalid-action rate vs iteration")
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out_dir = ROOT / "docs" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"ablation-{env}.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    print(f"\n![{env}](results/ablation-{env}.png)")
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("warmstart", help="the shared SFT warm start of an environment (resumes when re-run)")
    w.add_argument("--env", choices=sorted(HORIZONS), required=True)
    w.add_argument("--set", action="append", help="extra override, as agentgym train --set")
    r = sub.add_parser("run", help="one ablation run from the warm start (resumes when re-run)")
    r.add_argument("--env", choices=sorted(HORIZONS), required=True)
    r.add_argument("--schedule", choices=sorted(SCHEDULES), required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--iterations", type=int, default=None,
                   help=f"RL iterations in all (divisible by 3; default {ITERATIONS}; the from-base envs {DEFAULT_ITERATIONS['babyai-base']})")
    r.add_argument("--variant", choices=sorted(VARIANTS), default=None,
                   help="a variant of the schedule: turn-level credit, async RL or the renormalised ratio of "
                        "constrained replies (its own run id and row in the report)")
    r.add_argument("--set", action="append", help="extra override, as agentgym train --set")
    c = sub.add_parser("record", help="rewrite a finished run's record from MLflow, keeping its provenance")
    c.add_argument("--env", choices=sorted(HORIZONS), required=True)
    c.add_argument("--schedule", choices=sorted(SCHEDULES), required=True)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--variant", choices=sorted(VARIANTS), default=None)
    sub.add_parser("report", help="table and plots of the finished runs")
    args = p.parse_args()
    return {"warmstart": cmd_warmstart, "run": cmd_run, "record": cmd_record, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
