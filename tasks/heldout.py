"""Prefect tasks of the before/after held-out evaluation (``agentgym.evaluation.before_after``).

Each result is logged once to the pipeline's MLflow run -- the family series ``heldout/greedy_at_1``
(at the global step where the policy stopped training; ``agentgym.evaluation.heldout_metrics``), the
details ``heldout-by-policy/<policy>.<env>.<category>...`` and the whole report as the artifact
``heldout/<policy>.json`` -- and a re-run (resume) reads it back instead of playing the episodes again.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from agentgym.evaluation import learning_curve

from agentgym.chat import ChatFormatter
from agentgym.config import PipelineConfig
from agentgym.evaluation.before_after import comparison_table, heldout_horizon, random_valid_report
from agentgym.evaluation.heldout_metrics import FAMILY, RANDOM, detail_key, heldout_step
from agentgym.evaluation.metrics import EvalReport, evaluate
from agentgym.infra import progress
from agentgym.registry.champion import materialize
from agentgym.rollout.engines import engine_for
from agentgym.schedule import stage_start
from agentgym.tracking.artifact_keys import artifact_key
from agentgym.tracking.tracker import Tracker


def _logged(tracker: Tracker, parent: str, label: str) -> dict[str, Any] | None:
    path = f"heldout/{label}.json"
    return tracker.load_dict(parent, path) if tracker.has_artifact(parent, path) else None


def _log(tracker: Tracker, config: PipelineConfig, parent: str, label: str,
         result: dict[str, Any]) -> dict[str, Any]:
    step = heldout_step(config.stages, label)
    metrics: dict[str, float] = {}
    for mode in ("greedy", "sampled"):
        if result.get(mode):
            report = EvalReport.from_dict(result[mode]).metrics(label)  # "<label>/<env>/<category>/..."
            metrics.update({detail_key(label, k[len(label) + 1:]): v for k, v in report.items()})
    metrics[detail_key(label, "seconds")] = result["seconds"]
    tracker.log_metrics(parent, {**metrics, **family_metrics(tracker, config, parent, label, result)}, step=step)
    tracker.log_json(parent, result, f"heldout/{label}.json")
    return result


def family_metrics(tracker: Tracker, config: PipelineConfig, parent: str, label: str,
                   result: dict[str, Any]) -> dict[str, float]:
    """The held-out result as the family series (``heldout/greedy_at_1``, ``heldout/avg_at_<k>``,
    ``heldout/pass_at_<k>``) and the random baseline beside it (``heldout/random_valid``). The
    series follows the policy RL trains: the base model's point is left out when an SFT warm start
    (also at step 0) is what RL starts from."""
    if label == RANDOM:
        return {f"{FAMILY}/random_valid": EvalReport.from_dict(result["sampled"]).score}
    if label == "base" and config.sft.enabled:
        return {}
    out: dict[str, float] = {}
    if result.get("greedy"):
        out[f"{FAMILY}/greedy_at_1"] = EvalReport.from_dict(result["greedy"]).score
    if result.get("sampled"):
        sampled = EvalReport.from_dict(result["sampled"])
        out[f"{FAMILY}/avg_at_{sampled.k}"] = sampled.score
        out[f"{FAMILY}/pass_at_{sampled.k}"] = sampled.score_pass
    random = _logged(tracker, parent, RANDOM)
    if random is not None:  # the floor at the same step, so the two series read together
        out[f"{FAMILY}/random_valid"] = EvalReport.from_dict(random["sampled"]).score
    return out


@task(name="heldout_random_valid", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def heldout_random_valid(config: PipelineConfig, parent_mlflow_id: str) -> dict[str, Any]:
    """The random-valid-action baseline on the eval tasks (mean over ``heldout.random_seeds``)."""
    tracker = Tracker.from_config(config.tracking)
    done = _logged(tracker, parent_mlflow_id, RANDOM)
    if done is not None:
        return done
    t0 = time.perf_counter()
    report = random_valid_report(config)
    return _log(tracker, config, parent_mlflow_id, RANDOM, {
        "label": RANDOM, "model": None, "sampled": report.to_dict(), "greedy": None,
        "seconds": time.perf_counter() - t0})


@task(name="heldout_policy", task_run_name="heldout_policy[{label}]", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def heldout_policy(config: PipelineConfig, parent_mlflow_id: str, label: str, model: str) -> dict[str, Any]:
    """Greedy@1 (and with ``heldout.k > 1`` Avg@k / Pass@k) of the policy ``model`` (a model
    name, folder or checkpoint URI) on the eval tasks, under ``label``."""
    tracker = Tracker.from_config(config.tracking)
    done = _logged(tracker, parent_mlflow_id, label)
    if done is not None:
        return done
    h = config.heldout
    t0 = time.perf_counter()
    path = materialize(model, config.tracking.tracking_uri, config.model.cache_dir)
    engine, tokenizer = engine_for(config, path)
    formatter = ChatFormatter(tokenizer, config.rollout.response_prefix)
    horizon = heldout_horizon(config)
    try:
        def on_turn(turn: int, live: int, mode: str) -> None:
            progress.report("phase", name=f"held-out {label} ({mode})", done=turn + 1, total=horizon,
                            postfix={"live episodes": live})

        greedy = evaluate(engine, formatter, config, k=1, horizon=horizon, greedy=True, seed=h.seed,
                          on_turn=lambda t, n: on_turn(t, n, "greedy"))
        sampled = evaluate(engine, formatter, config, k=h.k, horizon=horizon, seed=h.seed,
                           on_turn=lambda t, n: on_turn(t, n, f"{h.k} samples")) if h.k > 1 else None
    finally:
        engine.close()
    seconds = time.perf_counter() - t0
    get_run_logger().info("held-out %s: greedy@1 %.3f (%.0f s)", label, greedy.score, seconds)
    return _log(tracker, config, parent_mlflow_id, label, {
        "label": label, "model": model, "greedy": greedy.to_dict(),
        "sampled": sampled.to_dict() if sampled else None, "seconds": seconds})


def publish_comparison(run_id: str, results: dict[str, dict[str, Any]], link: str) -> list[dict[str, Any]]:
    """The side-by-side table as one Prefect artifact; returns its rows."""
    rows = comparison_table(results)
    horizon = next((r.get("greedy") or r["sampled"])["horizon"] for r in results.values())
    create_table_artifact(
        key=artifact_key("heldout", run_id), table=rows,
        description=f"Held-out success of run {run_id} at horizon {horizon}: random-valid (mean over "
                    f"seeds), base model, after SFT, after each ScalingInter-RL stage (greedy@1). {link}")
    return rows


@task(name="publish_learning_curve", cache_policy=NO_CACHE)
def publish_learning_curve(config: PipelineConfig, run_id: str, parent_mlflow_id: str) -> str:
    """Draw the run's learning curve so far (held-out success against RL environment steps and
    minutes of running, beside the random-valid baseline) and log it as the pipeline run's artifact
    ``learning_curve.png``; returns its URI. Redrawn after every held-out evaluation."""
    import tempfile

    tracker = Tracker.from_config(config.tracking)
    ends = [stage_start(config.stages, k + 1) for k in range(len(config.stages))]
    curve = learning_curve.from_mlflow(tracker.client, parent_mlflow_id, ends)
    with tempfile.TemporaryDirectory(prefix="agentgym-curve-") as tmp:
        path = learning_curve.plot(curve, f"{tmp}/learning_curve.png",
                                   f"run {run_id}: held-out greedy success at horizon {heldout_horizon(config)} "
                                   f"on {sum(len(e.eval_tasks or []) for e in config.envs)} tasks")
        tracker.log_file(parent_mlflow_id, path)
    return tracker.artifact_uri(parent_mlflow_id, "learning_curve.png")
