"""Prefect task: evaluate a policy on the held-out tasks, log the scores, publish a table.

Two ways to name the policy:

* ``run_id`` of a live training run (no ``model``): the run's in-memory session is evaluated
  -- its current weights, no reload (what the training flow does every ``eval_every`` steps);
* ``model``: a model reference for :func:`agentgym.registry.materialize` -- a local HF folder, a
  checkpoint artifact URI, ``models:/agentgym-policy@champion``, ``tiny``...

Returns a small JSON-able dict: the score, the flat metrics and each report as a dict.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from agentgym.config import PipelineConfig
from agentgym.evaluation import EvalReport, eval_targets, evaluate
from agentgym.tracking import Tracker


def artifact_key(*parts: Any) -> str:
    """A valid Prefect artifact key (lower-case letters, digits, dashes) from ``parts``."""
    key = re.sub(r"[^a-z0-9-]+", "-", "-".join(str(p) for p in parts if p is not None).lower())
    return re.sub(r"-{2,}", "-", key).strip("-")[:200] or "evaluation"


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


@task(name="evaluate_checkpoint", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def evaluate_checkpoint(
    config: PipelineConfig,
    model: str | None = None,
    run_id: str | None = None,
    k: int = 4,
    greedy_too: bool = False,
    seed: int = 0,
    mlflow_run_id: str | None = None,
    step: int | None = None,
    prefix: str = "eval",
    publish: bool = True,
    label: str | None = None,
    tasks_by_env: dict[str, list[int]] | None = None,
    horizon: int | None = None,
) -> dict[str, Any]:
    """Evaluate a policy (``model`` or the live session of ``run_id``) on every env's
    ``eval_tasks``: Avg@k/Pass@k sampled, plus greedy when ``greedy_too``.

    Metrics go to MLflow run ``mlflow_run_id`` (if given) as ``{prefix}/<env>/<category>/...``
    at ``step``; a Prefect table artifact is published when ``publish``.
    """
    logger = get_run_logger()
    if (model is None) == (run_id is None):
        raise ValueError("evaluate_checkpoint needs exactly one of model= (a checkpoint) or run_id= (a live run)")
    if not eval_targets(config, tasks_by_env):
        logger.warning("no environment has eval_tasks: nothing to evaluate")
        return {"model": model, "run_id": run_id, "local_path": None, "score": float("nan"),
                "greedy_score": None, "metrics": {}, "seconds": 0.0, "sampled": None, "greedy": None}
    t0 = time.perf_counter()
    owned = None
    local_path = None
    if run_id is not None:
        from tasks.runtime import get_session

        session = get_session(config, run_id)
        engine, formatter = session.engine, session.formatter
    else:
        from agentgym.chat import ChatFormatter
        from agentgym.engines import create_engine
        from agentgym.registry import materialize

        local_path = materialize(model, config.tracking.tracking_uri, config.model.cache_dir)
        engine, tokenizer = create_engine(config.rollout.engine, local_path, config.model.dtype)
        formatter = ChatFormatter(tokenizer, config.rollout.response_prefix)
        owned = engine
    try:
        reports = [evaluate(engine, formatter, config, tasks_by_env, k=k, horizon=horizon,
                            greedy=False, seed=seed)]
        if greedy_too:
            reports.append(evaluate(engine, formatter, config, tasks_by_env, k=1, horizon=horizon,
                                    greedy=True, seed=seed))
    finally:
        if owned is not None:
            owned.close()
    metrics: dict[str, float] = {}
    for rep in reports:
        metrics.update(rep.metrics(prefix))
    seconds = time.perf_counter() - t0
    metrics[f"{prefix}/seconds"] = seconds
    if mlflow_run_id:
        Tracker(config.tracking.tracking_uri, config.tracking.experiment).log_metrics(
            mlflow_run_id, metrics, step=step or 0)
    what = label or model or f"run {run_id}"
    if publish:
        create_table_artifact(
            table=merged_table(reports),
            key=artifact_key("eval", label or (run_id and f"{run_id}-step-{step}") or model),
            description=report_markdown(f"Evaluation of {what}", reports),
        )
    score = reports[0].score
    logger.info("evaluation of %s: score %s (%.1f s)", what,
                f"{score:.4f}" if math.isfinite(score) else "nan", seconds)
    return {
        "model": model, "run_id": run_id, "local_path": str(local_path) if local_path else None,
        "score": score, "greedy_score": reports[1].score if greedy_too else None,
        "metrics": metrics, "seconds": seconds,
        "sampled": reports[0].to_dict(), "greedy": reports[1].to_dict() if greedy_too else None,
    }
