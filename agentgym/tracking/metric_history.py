"""A metric's history with one value per step.

MLflow keeps every value logged at a step. A resumed run that redid an iteration logs that step
again (``Tracker.log_metrics_once(again=True)``), so a raw ``get_metric_history`` holds the step
twice: summing it double-counts the redone iteration, and reading it in step order puts the first
attempt's timestamp beside the second's (a negative gap between them). Readers take the value
logged last.
"""

from __future__ import annotations

from collections.abc import Iterable

from mlflow.entities import Metric


def latest_per_step(metrics: Iterable[Metric]) -> list[Metric]:
    """One metric per step, the one logged last (greatest timestamp; on a tie, the later in
    ``metrics``' order), in step order."""
    last: dict[int, Metric] = {}
    for m in metrics:
        kept = last.get(m.step)
        if kept is None or m.timestamp >= kept.timestamp:
            last[m.step] = m
    return [last[s] for s in sorted(last)]


def metric_history(client, run_id: str, key: str) -> list[Metric]:
    """``key``'s history in MLflow run ``run_id`` (``MlflowClient``), one value per step
    (``latest_per_step``)."""
    return latest_per_step(client.get_metric_history(run_id, key))
