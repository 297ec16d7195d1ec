"""Prefect tasks: evaluate a policy on the held-out tasks, log the scores, publish a table.

One task per way to name the policy:

* ``evaluate_live_run(config, run_id)``: the in-memory session of a live training run -- its
  current weights, no reload (what the training flow does every ``eval_every`` steps);
* ``evaluate_model(config, model)``: a model reference for :func:`agentgym.registry.champion.materialize`
  -- a local HF folder, a checkpoint artifact URI, ``models:/agentgym-policy@champion``, ``tiny``...

Both take ``EvalSettings`` (how to evaluate) and ``EvalSink`` (where the scores go) and return
a small JSON-able dict: the score, the flat metrics and each report as a dict.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from agentgym.chat import ChatFormatter
from agentgym.config import PipelineConfig
from agentgym.evaluation.metrics import EvalReport, eval_targets, evaluate
from agentgym.registry.champion import materialize
from agentgym.rollout.engines import engine_for
from agentgym.rollout.engines.base import InferenceEngine
from agentgym.tracking.artifact_keys import artifact_key
from agentgym.tracking.tracker import Tracker
from tasks.runtime import get_session


@dataclass(frozen=True)
class EvalSettings:
    """How to evaluate: ``k`` samples per task (Avg@k / Pass@k), plus greedy decoding when
    ``greedy_too``; ``tasks_by_env`` / ``horizon`` replace the config's eval_tasks / last
    stage's horizon when given."""

    k: int = 4
    greedy_too: bool = False
    seed: int = 0
    tasks_by_env: dict[str, list[int]] | None = None
    horizon: int | None = None


@dataclass(frozen=True)
class EvalSink:
    """Where the scores go: MLflow run ``mlflow_run_id`` (if given) as ``{prefix}/<env>/<category>/...``
    at ``step``, and a Prefect table artifact when ``publish`` (its key from ``label``)."""

    mlflow_run_id: str | None = None
    step: int = 0
    prefix: str = "eval"
    publish: bool = True
    label: str | None = None


def report_markdown(title: str, reports: list[EvalReport]) -> str:
    lines = [f"### {title}", ""]
    for r in reports:
        lines.append(f"- {r.mode}: score (mean over envs of overall {'greedy@1' if r.greedy else f'avg@{r.k}'}) "
                     f"= {r.score:.4f}; k={r.k}, n={r.n}, horizon={r.horizon}, seed={r.seed}")
    return "\n".join(lines)


def merged_table(reports: list[EvalReport]) -> list[dict[str, Any]]:
    """One row per (env, category) with the columns of every report side by side."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for rep in reports:
        for row in rep.table():
            key = (row["env"], row["category"])
            merged = rows.setdefault(key, {"env": row["env"], "category": row["category"],
                                           "tasks": row["tasks"]})
            for col, val in row.items():
                if col in ("env", "category", "tasks"):
                    continue
                merged[col if col not in merged else f"{rep.mode}_{col}"] = val
    return list(rows.values())


def _reports(engine: InferenceEngine | None, formatter: ChatFormatter, config: PipelineConfig,
             settings: EvalSettings, play: Any = None) -> list[EvalReport]:
    """``play``: how episodes are played instead of ``engine`` (a session's rollout workers)."""
    s = settings
    reports = [evaluate(engine, formatter, config, s.tasks_by_env, k=s.k, horizon=s.horizon, greedy=False,  # type: ignore[arg-type]
                        seed=s.seed, play=play)]
    if s.greedy_too:
        reports.append(evaluate(engine, formatter, config, s.tasks_by_env, k=1, horizon=s.horizon, greedy=True,  # type: ignore[arg-type]
                                seed=s.seed, play=play))
    return reports


def _record(config: PipelineConfig, reports: list[EvalReport], sink: EvalSink, what: str,
            default_label: str, seconds: float) -> dict[str, Any]:
    """Log the reports' metrics and publish their table as ``sink`` says; the result's core."""
    metrics: dict[str, float] = {}
    for rep in reports:
        metrics.update(rep.metrics(sink.prefix))
    metrics[f"{sink.prefix}/seconds"] = seconds
    if sink.mlflow_run_id:
        Tracker.from_config(config.tracking).log_metrics(
            sink.mlflow_run_id, metrics, step=sink.step)
    if sink.publish:
        create_table_artifact(table=merged_table(reports), key=artifact_key("eval", sink.label or default_label),
                              description=report_markdown(f"Evaluation of {what}", reports))
    score = reports[0].score
    get_run_logger().info("evaluation of %s: score %s (%.1f s)", what,
                          f"{score:.4f}" if math.isfinite(score) else "nan", seconds)
    return {"score": score, "greedy_score": reports[1].score if len(reports) > 1 else None,
            "metrics": metrics, "seconds": seconds, "sampled": reports[0].to_dict(),
            "greedy": reports[1].to_dict() if len(reports) > 1 else None}


def _nothing_to_evaluate(config: PipelineConfig, settings: EvalSettings) -> dict[str, Any] | None:
    if eval_targets(config, settings.tasks_by_env):
        return None
    get_run_logger().warning("no environment has eval_tasks: nothing to evaluate")
    return {"score": float("nan"), "greedy_score": None, "metrics": {}, "seconds": 0.0,
            "sampled": None, "greedy": None}


def _model_run_name(parameters: dict[str, Any]) -> str:
    sink = parameters.get("sink")
    return f"evaluate_model[{(sink.label if sink else None) or parameters.get('model')}]"


def _live_run_name(parameters: dict[str, Any]) -> str:
    sink = parameters.get("sink")
    return f"evaluate_live_run[step {sink.step if sink else 0}]"


# (task_run_name: prefect's callback Protocol also declares a classmethod no plain function has)
@task(name="evaluate_model", task_run_name=_model_run_name, cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)  # type: ignore[arg-type]
def evaluate_model(config: PipelineConfig, model: str, settings: EvalSettings = EvalSettings(),  # noqa: B008
                   sink: EvalSink = EvalSink()) -> dict[str, Any]:  # noqa: B008
    """Load ``model`` (folder, checkpoint URI, ``models:/name@alias``, a model name) into its own
    engine and evaluate it on every env's ``eval_tasks``."""
    out = {"model": model, "run_id": None, "local_path": None}
    empty = _nothing_to_evaluate(config, settings)
    if empty is not None:
        return {**out, **empty}
    t0 = time.perf_counter()
    local_path = materialize(model, config.tracking.tracking_uri, config.model.cache_dir)
    engine, tokenizer = engine_for(config, local_path)
    try:
        reports = _reports(engine, ChatFormatter(tokenizer, config.rollout.response_prefix), config, settings)
    finally:
        engine.close()
    return {**out, "local_path": str(local_path),
            **_record(config, reports, sink, sink.label or model, model, time.perf_counter() - t0)}


@task(name="evaluate_live_run", task_run_name=_live_run_name, cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)  # type: ignore[arg-type]
def evaluate_live_run(config: PipelineConfig, run_id: str, settings: EvalSettings = EvalSettings(),  # noqa: B008
                      sink: EvalSink = EvalSink()) -> dict[str, Any]:  # noqa: B008
    """Evaluate the current policy of live training run ``run_id`` in place (its session's
    engine: nothing is reloaded)."""
    out = {"model": None, "run_id": run_id, "local_path": None}
    empty = _nothing_to_evaluate(config, settings)
    if empty is not None:
        return {**out, **empty}
    t0 = time.perf_counter()
    session = get_session(config, run_id)
    reports = _reports(None, session.formatter, config, settings, play=session.play_episodes)
    return {**out, **_record(config, reports, sink, sink.label or f"run {run_id}",
                             f"{run_id}-step-{sink.step}", time.perf_counter() - t0)}
