"""The paper's Table 1 at this project's scale: every shipped environment config, four rows.

Columns: the shipped configs ``configs/<env>.yaml`` (``COLUMNS``: babyai, textcraft, sciworld,
deepsearch, miniwob as the stand-in for WebArena, textworld_express), and ``mixed`` scored per
environment (its BabyAI and TextCraft held-out tasks, one column each). Rows:

* ``random`` -- a uniformly random valid action each turn, 10 policy seeds (``RANDOM_SEEDS``);
* ``base`` -- SmolLM2-135M-Instruct as the config decodes it, greedy, one episode per task;
* ``scaling`` -- after ScalingInter-RL from the base model: the config's own stages (horizons),
  ``ITERATIONS_PER_STAGE[env]`` iterations each (sized so one run takes <= ~40 minutes here);
* ``long`` -- after a fixed long horizon (the config's last stage horizon) from the base model at
  the same environment-step budget as the scaling run of the same seed (``schedule.max_env_steps``).

Every row is scored on the config's held-out ``eval_tasks`` (>= 32 per environment, disjoint from
its training tasks; tests/bench/test_table1_configs.py) at the held-out horizon (``heldout.horizon``
or the last stage's), greedy, with the same environment reset seed. Commands, one per cell; each
resumes when re-run (the RL cells' run ids are fixed by env, schedule and seed -- ``run_id``; an
evaluation cell is redone from scratch, its record replaced)::

    .venv/bin/python bench/learning/table1.py random --env babyai        # 10 seeds
    .venv/bin/python bench/learning/table1.py base --env babyai
    .venv/bin/python bench/learning/table1.py probe --env babyai         # minutes per RL iteration
    .venv/bin/python bench/learning/table1.py run --env babyai --schedule scaling --seed 0
    .venv/bin/python bench/learning/table1.py run --env babyai --schedule long --seed 0
    .venv/bin/python bench/learning/table1.py report                     # Markdown table

The environment-step budget: the long run gets ``schedule.max_env_steps`` = the scaling run's
environment steps (its committed record), so the pipeline ends it after the iteration that spends
them (at most one iteration over), and an iteration cap that cannot bind first (``long_cap``: one
step per episode). The long run's record keeps both runs' steps; ``report`` prints the ratio.
Long records made before the budget existed (iterations estimated from the scaling run's last
stage, run ids without ``-budget``) are marked so in the ratio table. A ``run --schedule long``
before the scaling run of its seed has finished is refused.

Records: every cell writes ``docs/results/table1/<cell>.json`` (``results_io``: command, commit,
machine, load; and per environment the held-out task ids with the success -- and the episode
reward, SciWorld's running score / 100 -- of every task under every seed). ``report`` reads only
those files, so the table outlives the machine; intervals are ``bootstrap.mean_interval``
(percentile bootstrap over tasks and, where a cell has several, seeds). MLflow:
``sqlite:///mlflow-table1.db``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bootstrap.py beside this script
sys.path.insert(1, str(ROOT / "bench"))  # results_io.py
import results_io  # noqa: E402

TRACKING = "sqlite:///mlflow-table1.db"
RECORDS = ROOT / "docs" / "results" / "table1"
#: the Table 1 columns: a config each (mixed is scored per environment of its own)
COLUMNS = {"babyai": "configs/babyai.yaml", "textcraft": "configs/textcraft.yaml",
           "sciworld": "configs/sciworld.yaml", "deepsearch": "configs/deepsearch.yaml",
           "miniwob": "configs/miniwob.yaml", "textworld_express": "configs/textworld_express.yaml",
           "mixed": "configs/mixed.yaml"}
ROWS = ("random", "base", "scaling", "long")
RL_ROWS = ("scaling", "long")
ROW_TITLES = {"random": "random valid action (10 seeds)", "base": "base SmolLM2-135M-Instruct",
              "scaling": "after ScalingInter-RL (from base)", "long": "after fixed long horizon, same env steps"}
RANDOM_SEEDS = 10
#: RL iterations per stage of the config's own stages, meant to keep one run (its final held-out
#: evaluation included) <= ~40 min on the idle 2-core machine, sized from the probes
#: (docs/results/table1/probes/) and checked by the runs' minutes (each record's wall_min;
#: docs/results.md has both). sciworld's is an estimate: no probe of it has updated.
ITERATIONS_PER_STAGE = {"babyai": 8, "textcraft": 8, "sciworld": 2, "deepsearch": 6, "miniwob": 8,
                        "textworld_express": 4, "mixed": 8}
#: the score reported beside success where success is rare: SciWorld's 0-100 (mean final running
#: score x 100); the adapter's reward is the running score / 100, the episode keeps its last value
SCORED = {"sciworld": 100.0}
#: columns whose RL rows are not run because their probe shows no reward to learn from: the
#: reason and the probe record (docs/results/table1/probes/) shown in those cells instead (any
#: other probe the reason names earned nothing too; tests/bench/test_table1.py). Deep Search left
#: it when its config took rollout.action_temperature 10 (probes/deepsearch-stage0-at10.json).
NO_SIGNAL = {"sciworld": ("free text, horizon 8: 0 of 8 episodes, every action invalid, no update; its 417 "
                          "valid actions listed instead: 0 of 8 score, the replies wait, ask for the task or "
                          "look around, probes/sciworld-stage0-listed.json; and drawn near-uniformly from the "
                          "list (action_temperature 10): 0 of 8 score, 5 episodes ended by focusing on a wrong "
                          "object, probes/sciworld-stage0-listed-at10.json", "probes/sciworld-stage0.json")}
#: the paper's Table 1 (arXiv 2509.08755), per our column: (ScalingInter-7B, Qwen2.5-7B-Instruct)
PAPER = {"miniwob": ("WebArena", 26.00, 9.76), "deepsearch": ("Deep Search", 38.25, 18.75),
         "textcraft": ("TextCraft", 91.00, 42.00), "babyai": ("BabyAI", 96.67, 66.67),
         "sciworld": ("SciWorld", 57.00, 1.50)}


def config_path(env: str) -> Path:
    return ROOT / COLUMNS[env]


def tracking_uri() -> str:
    path = Path(TRACKING.removeprefix("sqlite:///"))
    return f"sqlite:///{path if path.is_absolute() else ROOT / path}"


def cell_id(env: str, row: str, seed: int | None = None) -> str:
    """The id of a cell's record and (RL rows) of its run: ``table1-<env>-<row>[-s<seed>]``."""
    if env not in COLUMNS:
        raise ValueError(f"unknown column {env!r}; the columns are {sorted(COLUMNS)}")
    if row not in ROWS:
        raise ValueError(f"unknown row {row!r}; the rows are {ROWS}")
    if (row in RL_ROWS) != (seed is not None):
        raise ValueError(f"row {row!r} {'needs' if row in RL_ROWS else 'takes no'} seed")
    return f"table1-{env}-{row}" + (f"-s{seed}" if seed is not None else "")


def _shown(path: Path) -> Path:
    """A record's path as printed: relative to the repository when inside it."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def record_path(cell: str) -> Path:
    return RECORDS / f"{cell}.json"


def single_stage(env: str) -> bool:
    """The config has one stage (miniwob): ScalingInter-RL is then a fixed horizon, the long row the
    scaling row."""
    return len(load_cfg(env).stages) == 1


def load_cfg(env: str, sets: list[str] | None = None):
    from agentgym.config import load_config

    return load_config(config_path(env), list(sets or []))


def heldout_horizon(env: str) -> int:
    from agentgym.evaluation.before_after import heldout_horizon as h

    return h(load_cfg(env))


def stages(env: str, schedule: str, iterations: int | None = None) -> list[dict[str, int]]:
    """The RL run's stages: ``scaling`` the config's own horizons (and stage task subsets, if any)
    with ``iterations`` (default ``ITERATIONS_PER_STAGE[env]``) each; ``long`` one stage at the
    held-out horizon (the config's last stage's unless it sets ``heldout.horizon``) of
    ``iterations`` (required), on all the training tasks: the fixed-horizon baseline has no
    curriculum of either kind."""
    if schedule == "scaling":
        n = iterations or ITERATIONS_PER_STAGE[env]
        return [s.model_copy(update={"iterations": n}).model_dump(exclude_none=True) for s in load_cfg(env).stages]
    if schedule == "long":
        if not iterations:
            raise ValueError("the long schedule's iterations come from the scaling run's budget (long_cap)")
        return [{"horizon": heldout_horizon(env), "iterations": int(iterations)}]
    raise ValueError(f"unknown schedule {schedule!r}")


def long_cap(budget: float, episodes_per_iteration: int) -> int:
    """The long run's iteration count: a cap that ``schedule.max_env_steps`` = ``budget`` always
    reaches first, since every episode plays at least one environment step (dynamic sampling only
    adds episodes to an iteration)."""
    if budget <= 0 or episodes_per_iteration <= 0:
        raise ValueError(f"no budget to spend: {budget} env steps, {episodes_per_iteration} episodes an iteration")
    return max(1, math.ceil(budget / episodes_per_iteration))


# A config changed after its cells were run: the new runs get this suffix, so that they start
# fresh instead of resuming (or being refused by) the finished runs of the old config in MLflow.
# The old config's records were moved out of the table (docs/results/table1/<env>-<old>/).
# babyai: "at3" (rollout.action_temperature 3: seed 1's stage 0 took off; records in babyai-at3-1map/),
# then "m6" (and six training maps a level instead of one: the held-out maps are other maps)
# mixed: "m6", babyai.yaml's "m6" changes both at once (records of the one-map, t = 1 config in mixed-t1/)
CONFIG_REVISION = {"babyai": "m6", "mixed": "m6"}


def run_id(env: str, row: str, seed: int) -> str:
    """The pipeline run id of an RL cell: its cell id; a long row's with ``-budget`` (runs made
    since it stops at ``schedule.max_env_steps``: a different config from the earlier long runs,
    which a resume would refuse); then the env's ``CONFIG_REVISION`` if it has one."""
    cell = cell_id(env, row, seed)
    rid = f"{cell}-budget" if row == "long" else cell
    return f"{rid}-{CONFIG_REVISION[env]}" if env in CONFIG_REVISION else rid


def rl_overrides(env: str, schedule: str, seed: int, iterations: int | None = None,
                 max_env_steps: int | None = None) -> list[str]:
    """``agentgym train --set`` of one RL cell: the config as shipped, its schedule replaced (and
    for the long row its environment-step budget), held-out evaluation of the final policy only
    (random and base are their own cells: one random seed here, no base), at the table's held-out
    horizon, tracked in ``TRACKING``."""
    budget = [f"schedule.max_env_steps={int(max_env_steps)}"] if max_env_steps is not None else []
    return [f"tracking.tracking_uri={TRACKING}", f"tracking.experiment=agentgym-table1-{env}",
            f"schedule.stages={json.dumps(stages(env, schedule, iterations))}", *budget, f"seed={seed}",
            "heldout.enabled=true", "heldout.base=false", "heldout.every_stage=false", "heldout.random_seeds=1",
            f"heldout.horizon={heldout_horizon(env)}", "sft.enabled=false"]


# -- per-task results ------------------------------------------------------------------------------
def per_env_from_report(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``EvalReport.to_dict()`` (one greedy episode per task) -> ``{env label: {"tasks": [...],
    "success": [[...]], "reward": [[...]]}}`` with one seed row."""
    out: dict[str, dict[str, Any]] = {}
    for t in report["tasks"]:
        e = out.setdefault(t["env"], {"tasks": [], "success": [[]], "reward": [[]]})
        e["tasks"].append(int(t["task_id"]))
        e["success"][0].append(t["successes"] / t["n"] if t["n"] else float("nan"))
        e["reward"][0].append(float(t["reward_mean"]))
    return out


def random_per_env(cfg, seeds: int = RANDOM_SEEDS) -> dict[str, dict[str, Any]]:
    """The random valid action on every environment's eval tasks, ``seeds`` policy seeds: per
    environment the task ids and a success and a reward row per seed."""
    from agentgym.evaluation.before_after import heldout_horizon as hh
    from agentgym.evaluation.metrics import eval_targets

    horizon = hh(cfg)
    out: dict[str, dict[str, Any]] = {}
    for t in eval_targets(cfg):
        success, reward = random_rows(t.spec.name, list(t.tasks), horizon, seeds, cfg.heldout.seed, t.spec.kwargs,
                                      t.label)
        out[t.label] = {"tasks": list(t.tasks), "success": success, "reward": reward}
    return out


def random_rows(env: str, tasks: list[int], horizon: int, seeds: int, env_seed: int, kwargs: dict[str, Any],
                label: str) -> tuple[list[list[float]], list[list[float]]]:
    """The random valid action on ``tasks``, policy seeds ``0..seeds-1``: a success row and a
    reward row per seed, each over ``tasks`` in order."""
    from env_adapters.baselines import random_valid_action_success

    success, reward = [], []
    for seed in range(seeds):
        got = random_valid_action_success(env, tasks, horizon, seed=seed, env_seed=env_seed, **kwargs)
        success.append([float(got["per_task"][task]) for task in tasks])
        reward.append([float(got["per_task_reward"][task]) for task in tasks])
        print(f"  {label} seed {seed}: {got['success_rate']:.3f}", flush=True)
    return success, reward


def write_cell(cell: str, env: str, row: str, per_env: dict[str, Any], record: "results_io.Run",
               extra: dict[str, Any] | None = None) -> Path:
    """The cell's record, ``docs/results/table1/<cell>.json``."""
    results = {"cell": cell, "env": env, "row": row, "horizon": heldout_horizon(env), "per_env": per_env,
               **(extra or {})}
    path = record.write([], results, tag=cell.removeprefix("table1-"), out=record_path(cell))
    print(f"record: {_shown(path)}")
    return path


# -- commands --------------------------------------------------------------------------------------
def cmd_random(args: argparse.Namespace) -> int:
    cell = cell_id(args.env, "random")
    record = results_io.Run("table1", {"cell": cell, "env": args.env, "config": COLUMNS[args.env],
                                       "seeds": args.seeds, "set": args.set})
    per_env = random_per_env(load_cfg(args.env, args.set), args.seeds)
    write_cell(cell, args.env, "random", per_env, record, {"seeds": list(range(args.seeds))})
    return 0


def cmd_random_train(args: argparse.Namespace) -> int:
    """The random valid action on the *training* tasks at stage ``--stage``'s horizon (10 seeds):
    which tasks a policy can win by chance, the evidence for a stage's task subset. Scores the
    stage's subset, or with ``--all-tasks`` every training task of each environment. Record:
    ``docs/results/table1/probes/<env>-stage<N>-random.json`` (per task: seeds won)."""
    cfg = load_cfg(args.env, args.set)
    stage = cfg.stages[args.stage]
    record = results_io.Run("table1-random-train", {"env": args.env, "stage": args.stage, "horizon": stage.horizon,
                                                    "all_tasks": args.all_tasks, "seeds": args.seeds})
    per_env: dict[str, Any] = {}
    for e in cfg.envs:
        tasks = list(e.tasks) if args.all_tasks else list((stage.tasks or {}).get(e.name, e.tasks))
        success, _ = random_rows(e.name, tasks, stage.horizon, args.seeds, 0, e.kwargs, e.name)
        won = [int(sum(col)) for col in zip(*success)]
        per_env[e.name] = {"tasks": tasks, "seeds_won": won, "success": sum(won) / (len(tasks) * args.seeds)}
        print(f"{e.name}: {per_env[e.name]['success']:.3f}; seeds won per task: {dict(zip(tasks, won))}")
    out = record.write([], {"env": args.env, "stage": args.stage, "horizon": stage.horizon, "per_env": per_env},
                       tag=f"random-train-{args.env}",
                       out=RECORDS / "probes" / f"{args.env}-stage{args.stage}-random.json")
    print(f"record: {_shown(out)}")
    return 0


def cmd_base(args: argparse.Namespace) -> int:
    """The base model, greedy, with the config's decoding, on its eval tasks (as the pipeline's
    ``heldout_policy`` evaluates every policy: ``agentgym.evaluation.metrics.evaluate``)."""
    from agentgym.chat import ChatFormatter
    from agentgym.evaluation.before_after import heldout_horizon as hh
    from agentgym.evaluation.metrics import evaluate
    from agentgym.registry.champion import materialize
    from agentgym.rollout.engines import engine_for

    cell = cell_id(args.env, "base")
    cfg = load_cfg(args.env, args.set)
    record = results_io.Run("table1", {"cell": cell, "env": args.env, "config": COLUMNS[args.env],
                                       "model": cfg.model.name_or_path, "set": args.set})
    path = materialize(cfg.model.name_or_path, tracking_uri(), cfg.model.cache_dir)
    engine, tokenizer = engine_for(cfg, path)
    t0 = time.perf_counter()
    try:
        report = evaluate(engine, ChatFormatter(tokenizer, cfg.rollout.response_prefix), cfg, k=1, horizon=hh(cfg),
                          greedy=True, seed=cfg.heldout.seed,
                          on_turn=lambda t, n: print(f"  turn {t + 1}: {n} live", flush=True))
    finally:
        engine.close()
    rep = report.to_dict()
    write_cell(cell, args.env, "base", per_env_from_report(rep), record,
               {"seconds": time.perf_counter() - t0, "model": cfg.model.name_or_path})
    return 0


def _train(env: str, rid: str, sets: list[str]) -> int:
    cmd = [str(Path(sys.executable).parent / "agentgym"), "train", "-c", str(config_path(env)), "--run-id", rid]
    for s in sets:
        cmd += ["--set", s]
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT)


def _pipeline_run(client, rid: str):
    for exp in client.search_experiments():
        if not exp.name.startswith("agentgym-table1-"):
            continue
        found = client.search_runs([exp.experiment_id], filter_string=f"tags.`agentgym.run_id` = '{rid}' and "
                                   "tags.`agentgym.kind` = 'pipeline'")
        if found:
            return found[0]
    return None


def run_steps(client, run) -> list[float]:
    """Environment steps of every RL iteration of a pipeline run (episodes x turns per episode)."""
    from agentgym.tracking.metric_history import metric_history

    rid = run.info.run_id
    eps = {m.step: m.value for m in metric_history(client, rid, "episodes")}
    turns = {m.step: m.value for m in metric_history(client, rid, "turns_per_episode")}
    return [eps[s] * turns[s] for s in sorted(set(eps) & set(turns))]


def train_success(client, run_id: str) -> list[float]:
    """The training episodes' success rate of every RL iteration of a pipeline run, in order."""
    from agentgym.tracking.metric_history import metric_history

    return [m.value for m in metric_history(client, run_id, "success_rate")]  # in step order


def cmd_run(args: argparse.Namespace) -> int:
    from mlflow.tracking import MlflowClient

    cell = cell_id(args.env, args.schedule, args.seed)
    extra: dict[str, Any] = {}
    iterations = args.iterations
    if args.schedule == "long" and len(load_cfg(args.env).stages) == 1:
        print(f"{COLUMNS[args.env]} has one stage: its scaling run is already a fixed horizon at the longest "
              "horizon, so the long row is the scaling row", file=sys.stderr)
        return 2
    if args.schedule == "long" and not iterations:
        scaling = record_path(cell_id(args.env, "scaling", args.seed))
        if not scaling.exists():
            print(f"no finished scaling run of seed {args.seed}: its environment steps are the long run's budget; "
                  f"run first\n  .venv/bin/python bench/learning/table1.py run --env {args.env} --schedule scaling "
                  f"--seed {args.seed}", file=sys.stderr)
            return 2
        sc = json.loads(scaling.read_text())["results"]
        budget = int(round(sum(sc["steps_per_iteration"])))
        r = load_cfg(args.env).rollout
        iterations = long_cap(budget, r.tasks_per_iteration * r.group_size)
        extra.update(budget_env_steps=budget, max_env_steps=budget)
    sets = rl_overrides(args.env, args.schedule, args.seed, iterations, extra.get("max_env_steps")) + list(args.set or [])
    rid = run_id(args.env, args.schedule, args.seed)
    record = results_io.Run("table1", {"cell": cell, "env": args.env, "config": COLUMNS[args.env],
                                       "schedule": args.schedule, "seed": args.seed, "overrides": sets})
    rc = _train(args.env, rid, sets)
    if rc != 0:
        return rc
    client = MlflowClient(tracking_uri=tracking_uri())
    run = _pipeline_run(client, rid)
    if run is None or run.info.status != "FINISHED":
        print(f"note: no finished MLflow run {rid}: no record written", file=sys.stderr)
        return 1
    sched = stages(args.env, args.schedule, iterations)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        got = client.download_artifacts(run.info.run_id, f"heldout/stage-{len(sched) - 1}.json", tmp)
        report = json.loads(Path(got).read_text())
    steps = run_steps(client, run)
    write_cell(cell, args.env, args.schedule, per_env_from_report(report["greedy"]), record,
               {**extra, "seed": args.seed, "stages": sched, "steps_per_iteration": steps, "env_steps": sum(steps),
                "train_success": train_success(client, run.info.run_id),
                "wall_min": ((run.info.end_time or 0) - run.info.start_time) / 60000,
                "mlflow_run_id": run.info.run_id})
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    """Minutes per RL iteration: ``--iterations`` (default 1) iterations at the longest horizon
    (``--stage N``: at stage N's horizon on its training tasks), no held-out evaluation; prints each iteration's rollout and update seconds (MLflow
    ``rollout_seconds``, ``update_seconds``) and what it played. Its record:
    ``docs/results/table1/probes/<env>.json``."""
    from mlflow.tracking import MlflowClient

    from agentgym.config import StageSpec

    cfg_stages = load_cfg(args.env).stages
    if args.stage is None:
        played = StageSpec(horizon=max(s.horizon for s in cfg_stages), iterations=args.iterations)
    elif -len(cfg_stages) <= args.stage < len(cfg_stages):
        played = cfg_stages[args.stage].model_copy(update={"iterations": args.iterations})
    else:
        print(f"--stage {args.stage}: {COLUMNS[args.env]} has {len(cfg_stages)} stages", file=sys.stderr)
        return 2
    horizon, stage = played.horizon, played.model_dump(exclude_none=True)
    sets = [f"tracking.tracking_uri={TRACKING}", f"tracking.experiment=agentgym-table1-{args.env}",
            f"schedule.stages={json.dumps([stage])}",
            "heldout.enabled=false", "sft.enabled=false", "tracking.checkpoint_every=0"] + list(args.set or [])
    # a probe of a changed config (or other --set) is a new run, not a resume of the last probe's
    digest = hashlib.sha256("\n".join([config_path(args.env).read_text(), *sets]).encode()).hexdigest()[:8]
    rid = f"table1-probe-{args.env}-{digest}"
    record = results_io.Run("table1-probe", {"env": args.env, "horizon": horizon, "iterations": args.iterations,
                                             "stage": args.stage, "overrides": sets})
    t0 = time.perf_counter()
    rc = _train(args.env, rid, sets)
    wall = time.perf_counter() - t0
    from agentgym.tracking.metric_history import metric_history

    client = MlflowClient(tracking_uri=tracking_uri())
    run = _pipeline_run(client, rid)
    per_it = {}
    if run is not None:
        for key in ("rollout_seconds", "update_seconds", "episodes", "turns_per_episode",
                    "success_rate", "reward_mean", "invalid_action_rate", "format_error_rate"):
            per_it[key] = [m.value for m in metric_history(client, run.info.run_id, key)]
    out = record.write([], {"rc": rc, "wall_s": wall, "horizon": horizon, "per_iteration": per_it},
                       tag=f"probe-{args.env}", out=RECORDS / "probes" / (
                           args.env + ("" if args.stage is None else f"-stage{args.stage}")
                           + (f"-{args.label}" if args.label else "") + ".json"))
    print(json.dumps({"wall_min": wall / 60, **per_it}, indent=1))
    print(f"record: {_shown(out)}")
    return rc


# -- report ------------------------------------------------------------------------------------------
def precision(machine: dict[str, Any] | None) -> str:
    """What ``dtype: auto`` / ``trainer.bf16: auto`` resolved to on the machine a record names:
    bf16 where its CPU flags have bf16 instructions (``hardware.cpu_has_bf16``, the rule ``auto``
    itself follows), else fp32; "unknown" where the record keeps no flags."""
    from agentgym.models.hardware import cpu_has_bf16

    flags = (machine or {}).get("cpu_flags")
    if flags is None:
        return "unknown"
    return "bf16" if cpu_has_bf16(flags) else "fp32"


def load_records(folder: Path = RECORDS) -> list[dict[str, Any]]:
    """Every cell's ``results``, with ``precision`` added from the record's machine."""
    out = []
    for p in sorted(folder.glob("table1-*.json")):
        rec = json.loads(p.read_text())
        out.append({**rec["results"], "precision": precision(rec.get("machine"))})
    return out


def precision_line(records: list[dict[str, Any]]) -> str | None:
    """Which model cells (base and RL) ran in which precision, named where they are the minority:
    the machines of one kind differ in CPU flags, so a table's runs may mix bf16 and fp32."""
    model = [r for r in records if r["row"] != "random" and "precision" in r]
    if not model:
        return None
    usual = Counter(r["precision"] for r in model).most_common(1)[0][0]
    other = [f"{r['env']} {r['row']}" + (f" s{r['seed']}" if "seed" in r else "") + f" ({r['precision']})"
             for r in model if r["precision"] != usual]
    return (f"\nPrecision (`dtype: auto`, `trainer.bf16: auto`, from each record's CPU flags): {usual} for "
            + ("every base and RL cell" if not other else "the base and RL cells but " + ", ".join(other)) + ".")


def columns(records: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """The table's columns, ``(config, environment label, header)``: one per config, named after it
    (its environment label is the adapter's, e.g. ``textworld``), and one per environment of the
    mixed config (``mixed/<label>``)."""
    out = []
    for env, path in COLUMNS.items():
        names = list(dict.fromkeys(lab for r in records if r["env"] == env for lab in r["per_env"]))
        if env == "mixed":
            out += [(env, n, f"mixed/{n}") for n in names] or [(env, env, f"mixed ({Path(path).name})")]
        else:
            out.append((env, names[0] if names else env, f"{env} ({Path(path).name})"))
    return out


def cell_matrix(records: list[dict[str, Any]], env: str, row: str, label: str,
                key: str = "success") -> tuple[list[int], list[list[float]]] | None:
    """``(tasks, rows)`` of one cell: every seed's per-task values, one row per policy seed (the
    random row's 10 seeds, one row per RL run). Rows over other task lists are left out."""
    mine = sorted((r for r in records if r["env"] == env and r["row"] == row and label in r["per_env"]),
                  key=lambda r: r.get("seed", 0))
    if not mine:
        return None
    tasks = mine[0]["per_env"][label]["tasks"]
    rows = [v for r in mine if r["per_env"][label]["tasks"] == tasks for v in r["per_env"][label][key]]
    return tasks, rows


def cell_stats(records: list[dict[str, Any]], env: str, row: str, label: str,
               key: str = "success", scale: float = 1.0) -> dict[str, Any] | None:
    """Mean and 95 % bootstrap interval (``bootstrap.mean_interval``: tasks and seeds resampled)."""
    import numpy as np
    from bootstrap import mean_interval

    got = cell_matrix(records, env, row, label, key)
    if got is None:
        return None
    tasks, rows = got
    x = np.array(rows, dtype=float) * scale
    mean, lo, hi = mean_interval(x)
    return {"mean": mean, "lo": lo, "hi": hi, "tasks": len(tasks), "seeds": x.shape[0]}


PAIRED_TITLE = "ScalingInter-RL minus fixed long (paired on tasks)"


def paired_stats(records: list[dict[str, Any]], env: str, label: str) -> dict[str, Any] | None:
    """The ScalingInter-RL row minus the fixed-long row of one column, with its 95 % bootstrap
    interval paired on the held-out tasks (``bootstrap.paired_difference``: each draw resamples
    the tasks once for both rows and each row's seeds on their own). None unless both rows exist
    over the same tasks."""
    import numpy as np
    from bootstrap import paired_difference

    a, b = cell_matrix(records, env, "scaling", label), cell_matrix(records, env, "long", label)
    if a is None or b is None or a[0] != b[0]:
        return None
    diff, lo, hi = paired_difference(np.array(a[1], dtype=float), np.array(b[1], dtype=float))
    return {"mean": diff, "lo": lo, "hi": hi, "seeds": (len(a[1]), len(b[1]))}


def _fmt_signed(s: dict[str, Any]) -> str:
    return f"{s['mean']:+.3f} [{s['lo']:+.3f}, {s['hi']:+.3f}]"


def _seeds(n: int) -> str:
    return f" ({n} seed{'s' if n > 1 else ''})"


def _fmt(s: dict[str, Any] | None, digits: int = 3) -> str:
    if s is None:
        return "—"
    return f"{s['mean']:.{digits}f} [{s['lo']:.{digits}f}, {s['hi']:.{digits}f}]"


def budget_rows(records: list[dict[str, Any]]) -> list[str]:
    """Per (env, seed) with both RL runs: the scaling run's env steps, the long run's, the ratio,
    the long run's iterations, and how its length was set (the budget, or an estimate before the
    pipeline had one)."""
    out = []
    for r in records:
        if r["row"] == "long" and r.get("budget_env_steps"):
            how = "schedule.max_env_steps" if r.get("max_env_steps") else "estimated iterations (before the budget)"
            out.append(f"| {r['env']} | {r['seed']} | {r['budget_env_steps']:.0f} | {r['env_steps']:.0f} | "
                       f"{r['env_steps'] / r['budget_env_steps']:.2f} | {len(r['steps_per_iteration'])} | {how} |")
    return out


def report_markdown(records: list[dict[str, Any]], commands: dict[str, str] | None = None,
                    paper: bool = True) -> str:
    """The table (rows x columns, each cell mean [95 % interval] over held-out tasks and seeds), the
    SciWorld score row, the budget check and (``paper``) the paper's numbers beside."""
    cols = columns(records)
    lines = ["| policy | " + " | ".join(h for _, _, h in cols) + " |", "|---|" + "---|" * len(cols)]
    for row in ROWS:
        cells = []
        for env, lab, _ in cols:
            s = cell_stats(records, env, row, lab)
            if row == "long" and single_stage(env):
                cells.append("= scaling (one stage)")
            elif s is None and row in RL_ROWS and env in NO_SIGNAL:
                cells.append(f"no signal ({NO_SIGNAL[env][0]}; {NO_SIGNAL[env][1]})")
            elif s is None and row in RL_ROWS and commands is not None:
                cells.append("to run")
            else:
                cells.append(_fmt(s) + (_seeds(s["seeds"]) if s and row in RL_ROWS else ""))
        lines.append(f"| {ROW_TITLES[row]} | " + " | ".join(cells) + " |")
    paired = []
    for env, lab, _ in cols:  # the curriculum against the fixed long horizon, task by task
        d = paired_stats(records, env, lab)
        if d is None:
            paired.append("—")
        else:  # each row's own seeds: the long row may have fewer finished than the scaling row
            na, nb = d["seeds"]
            paired.append(_fmt_signed(d) + (_seeds(na) if na == nb else f" ({na} and {nb} seeds)"))
    lines.append(f"| {PAIRED_TITLE} | " + " | ".join(paired) + " |")
    tasks = []
    for env, lab, _ in cols:
        got = next((m for m in (cell_matrix(records, env, row, lab) for row in ROWS) if m), None)
        tasks.append(str(len(got[0])) if got else "—")
    lines.append("| held-out tasks | " + " | ".join(tasks) + " |")
    horizons = [str(next((r["horizon"] for r in records if r["env"] == env), "—")) for env, _, _ in cols]
    lines.append("| held-out horizon | " + " | ".join(horizons) + " |")
    for env, scale in SCORED.items():
        score = [f"{ROW_TITLES[row]}: {_fmt(cell_stats(records, env, row, env, 'reward', scale), 1)}"
                 for row in ROWS if cell_stats(records, env, row, env, "reward", scale)]
        if score:
            lines.append(f"\n{env} score (0-100, mean final running score x 100): " + "; ".join(score) + ".")
    budget = budget_rows(records)
    if budget:
        lines += ["\n| env | seed | scaling env steps (budget) | long env steps | long / scaling | long iterations | "
                  "long run's length |", "|---|---:|---:|---:|---:|---:|---|", *budget]
    prec = precision_line(records)
    if prec:
        lines.append(prec)
    if not paper:
        return "\n".join(lines)
    lines += ["\nThe paper's Table 1 (Qwen2.5-7B-Instruct and ScalingInter-7B, 7B parameters; ours: "
              "SmolLM2-135M-Instruct, 135M, about 52x smaller; MiniWoB++ stands in for WebArena):\n",
              "| | " + " | ".join(f"{PAPER[e][0]} (ours: {e})" for e in PAPER) + " |",
              "|---|" + "---:|" * len(PAPER),
              "| base Qwen2.5-7B-Instruct | " + " | ".join(f"{PAPER[e][2]:.2f}" for e in PAPER) + " |",
              "| ScalingInter-7B | " + " | ".join(f"{PAPER[e][1]:.2f}" for e in PAPER) + " |"]
    return "\n".join(lines)


REPORT_BEGIN = "<!-- table1 report: begin (written by `table1.py report --update`; edit the records, not this) -->"
REPORT_END = "<!-- table1 report: end -->"


def splice_report(doc: str, table: str) -> str:
    """``doc`` with the text between its REPORT_BEGIN and REPORT_END lines replaced by ``table``.
    Raises ValueError naming the missing marker, so a moved or deleted marker is never guessed at."""
    for marker in (REPORT_BEGIN, REPORT_END):
        if doc.count(marker) != 1:
            raise ValueError(f"the document must hold the line {marker!r} exactly once "
                             f"(found {doc.count(marker)}); put the two markers around the table")
    head, rest = doc.split(REPORT_BEGIN)
    _, tail = rest.split(REPORT_END)
    return f"{head}{REPORT_BEGIN}\n{table}\n{REPORT_END}{tail}"


def cmd_report(args: argparse.Namespace) -> int:
    records = load_records()
    if args.update is None:
        print(report_markdown(records, commands={}))
        return 0
    doc = args.update.read_text()
    new = splice_report(doc, report_markdown(records, commands={}, paper=False))
    args.update.write_text(new)
    print(f"{_shown(args.update)}: table {'rewritten' if new != doc else 'unchanged'}")
    return 0


def backfill_train_success(folder: Path = RECORDS) -> list[Path]:
    """Give each RL record written before ``train_success`` was recorded its training curve, from
    its MLflow run (``mlflow_run_id`` in ``TRACKING``); rewrites those records, returns them. A
    record whose run this machine's MLflow store lacks is left as it is."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri())
    done = []
    for path in sorted(folder.glob("table1-*.json")):
        rec = json.loads(path.read_text())
        res = rec["results"]
        if res["row"] not in RL_ROWS or "train_success" in res or "mlflow_run_id" not in res:
            continue
        try:
            curve = train_success(client, res["mlflow_run_id"])
        except MlflowException:
            continue
        if len(curve) != len(res["steps_per_iteration"]):
            continue
        res["train_success"] = curve
        path.write_text(json.dumps(rec, indent=1) + "\n")
        done.append(path)
    return done


def curve_figure(records: list[dict[str, Any]], env: str, out: Path) -> Path | None:
    """``env``'s RL cells as one figure: the training episodes' success per iteration against the
    cumulative environment steps (one line per row and seed; a vertical tick where a stage ends)
    and, at each line's end, its held-out success; the random and base rows' held-out success as
    horizontal lines. None when no RL record of ``env`` has a training curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    runs = sorted((r for r in records if r["env"] == env and r["row"] in RL_ROWS and r.get("train_success")),
                  key=lambda r: (r["row"], r.get("seed", 0)))
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colours = {"scaling": "tab:blue", "long": "tab:orange"}
    for label, ls in (("random", ":"), ("base", "--")):
        for r in records:
            if r["env"] == env and r["row"] == label:
                for name, d in r["per_env"].items():
                    held = float(np.mean(d["success"]))
                    ax.axhline(held, color="grey", ls=ls, lw=1, label=f"{label} held-out ({name}) {held:.3f}")
    for r in runs:
        xs = np.cumsum(r["steps_per_iteration"])
        ax.plot(xs, r["train_success"], color=colours[r["row"]], alpha=0.8, marker=".",
                ls="-" if r.get("seed", 0) == 0 else ("--" if r.get("seed") == 1 else "-."),
                label=f"{r['row']} s{r.get('seed', 0)} training")
        ends = np.cumsum([s["iterations"] for s in r["stages"]])[:-1]
        for e in ends:
            ax.axvline(xs[e - 1], color=colours[r["row"]], lw=0.5, alpha=0.4)
        for name, d in r["per_env"].items():
            ax.plot([xs[-1]], [float(np.mean(d["success"]))], marker="*", ms=12, color=colours[r["row"]], ls="none")
    ax.set_xlabel("environment steps")
    ax.set_ylabel("success")
    ax.set_ylim(-0.02, 1.02)
    ax.plot([], [], marker="*", ms=10, color="black", ls="none", label="held-out after RL")
    ax.set_title(f"{COLUMNS[env]}: training success per iteration, held-out after RL (stars)", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def cmd_curves(args: argparse.Namespace) -> int:
    for path in backfill_train_success():
        print(f"train_success added: {_shown(path)}")
    records = load_records()
    for env in (args.env or sorted(COLUMNS)):
        out = curve_figure(records, env, RECORDS / f"curves-{env}.png")
        if out is not None:
            print(f"figure: {_shown(out)}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("random", help=f"the random valid action, {RANDOM_SEEDS} seeds")
    r.add_argument("--env", choices=sorted(COLUMNS), required=True)
    r.add_argument("--seeds", type=int, default=RANDOM_SEEDS)
    r.add_argument("--set", action="append", help="extra override, as agentgym train --set")
    rt = sub.add_parser("random-train", help="the random valid action on a stage's training tasks (10 seeds)")
    rt.add_argument("--env", choices=sorted(COLUMNS), required=True)
    rt.add_argument("--stage", type=int, default=0)
    rt.add_argument("--all-tasks", action="store_true", help="every training task, not the stage's subset")
    rt.add_argument("--seeds", type=int, default=RANDOM_SEEDS)
    rt.add_argument("--set", action="append", help="extra override, as agentgym train --set")
    b = sub.add_parser("base", help="the base model, greedy")
    b.add_argument("--env", choices=sorted(COLUMNS), required=True)
    b.add_argument("--set", action="append", help="extra override, as agentgym train --set")
    rr = sub.add_parser("run", help="one RL cell from the base model (resumes when re-run)")
    rr.add_argument("--env", choices=sorted(COLUMNS), required=True)
    rr.add_argument("--schedule", choices=RL_ROWS, required=True)
    rr.add_argument("--seed", type=int, default=0)
    rr.add_argument("--iterations", type=int, default=None,
                    help="scaling: iterations per stage (default ITERATIONS_PER_STAGE); long: in all "
                         "(default: the scaling run's env-step budget)")
    rr.add_argument("--set", action="append", help="extra override, as agentgym train --set")
    pr = sub.add_parser("probe", help="minutes per RL iteration at the longest horizon (no held-out)")
    pr.add_argument("--env", choices=sorted(COLUMNS), required=True)
    pr.add_argument("--iterations", type=int, default=1)
    pr.add_argument("--stage", type=int, default=None,
                    help="play the config's stage N (its horizon and task subset; record probes/<env>-stageN.json) "
                         "instead of the longest horizon on all tasks")
    pr.add_argument("--set", action="append", help="extra override, as agentgym train --set")
    pr.add_argument("--label", default=None,
                    help="suffix of the record's name (probes/<env>[-stageN]-<label>.json), e.g. for a --set variant")
    rp = sub.add_parser("report", help="the Markdown table from the committed records")
    rp.add_argument("--update", type=Path, default=None, metavar="FILE",
                    help="rewrite the table between FILE's table1 report markers (docs/results.md) "
                         "instead of printing it (the paper's numbers are left out: the doc has its own)")
    cu = sub.add_parser("curves", help="each environment's RL cells as a figure, records/curves-<env>.png")
    cu.add_argument("--env", choices=sorted(COLUMNS), action="append", help="default: every environment with RL records")
    args = p.parse_args()
    return {"random": cmd_random, "random-train": cmd_random_train, "base": cmd_base, "run": cmd_run, "probe": cmd_probe,
            "report": cmd_report, "curves": cmd_curves}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
