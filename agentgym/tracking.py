"""MLflow tracking: a parent run per pipeline run, a child run per ScalingInter-RL stage.

Runs are found again by tags (``agentgym.run_id``, ``agentgym.stage``), so re-running a
pipeline with the same run id reuses its MLflow runs instead of creating new ones. Everything
goes through ``MlflowClient`` with explicit run ids: the fluent API keeps an active-run stack
per thread, which Prefect's task threads would get wrong.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunStatus
from mlflow.tracking import MlflowClient

TAG_RUN = "agentgym.run_id"
TAG_KIND = "agentgym.kind"
TAG_STAGE = "agentgym.stage"
TAG_DONE = "agentgym.stage_finished"


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, dict)) else str(v)
    return out


class Tracker:
    def __init__(self, tracking_uri: str, experiment: str):
        self.uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        self.experiment_id = exp.experiment_id if exp else self.client.create_experiment(experiment)

    def _find(self, **tags: str) -> str | None:
        filt = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        runs = self.client.search_runs([self.experiment_id], filter_string=filt, max_results=1,
                                       order_by=["attributes.start_time DESC"])
        return runs[0].info.run_id if runs else None

    def pipeline_run(self, run_id: str, config: dict[str, Any]) -> str:
        """The parent run of pipeline ``run_id`` (created, with the config as params, once)."""
        found = self._find(**{TAG_RUN: run_id, TAG_KIND: "pipeline"})
        if found:
            self.client.update_run(found, status="RUNNING")
            return found
        run = self.client.create_run(self.experiment_id, run_name=run_id,
                                     tags={TAG_RUN: run_id, TAG_KIND: "pipeline"})
        params = flatten(config)
        items = list(params.items())
        for i in range(0, len(items), 90):  # MLflow caps a batch at 100 params
            self.client.log_batch(run.info.run_id, params=[Param(k, v[:6000]) for k, v in items[i:i + 90]])
        self.client.log_text(run.info.run_id, json.dumps(config, indent=2), "config.json")
        return run.info.run_id

    def stage_run(self, parent: str, run_id: str, index: int, horizon: int, iterations: int) -> str:
        found = self._find(**{TAG_RUN: run_id, TAG_KIND: "stage", TAG_STAGE: str(index)})
        if found:
            return found
        run = self.client.create_run(
            self.experiment_id, run_name=f"{run_id}-stage{index}-h{horizon}",
            tags={TAG_RUN: run_id, TAG_KIND: "stage", TAG_STAGE: str(index),
                  "mlflow.parentRunId": parent},
        )
        self.client.log_batch(run.info.run_id, params=[
            Param(k, str(v))
            for k, v in {"stage": index, "horizon": horizon, "iterations": iterations}.items()
        ])
        return run.info.run_id

    def stage_finished(self, run_id: str, index: int) -> bool:
        found = self._find(**{TAG_RUN: run_id, TAG_KIND: "stage", TAG_STAGE: str(index)})
        if not found:
            return False
        return self.client.get_run(found).data.tags.get(TAG_DONE) == "true"

    def finish_stage(self, stage_run_id: str) -> None:
        self.client.set_tag(stage_run_id, TAG_DONE, "true")
        self.client.set_terminated(stage_run_id, RunStatus.to_string(RunStatus.FINISHED))

    def finish_pipeline(self, parent: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(parent, status)

    def log_metrics(self, mlflow_run_id: str, metrics: dict[str, Any], step: int) -> None:
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))]
        if batch:
            self.client.log_batch(mlflow_run_id, metrics=batch)

    def log_checkpoint(self, mlflow_run_id: str, folder: str | Path, step: int,
                       meta: dict[str, Any] | None = None) -> str:
        """Upload an HF folder as ``checkpoints/step-XXXXXX``; returns its artifact URI."""
        path = f"checkpoints/step-{step:06d}"
        self.client.log_artifacts(mlflow_run_id, str(folder), path)
        self.client.log_dict(mlflow_run_id, {"global_step": step, **(meta or {})}, f"{path}/agentgym_checkpoint.json")
        self.client.set_tag(mlflow_run_id, "agentgym.last_checkpoint", path)
        run = self.client.get_run(mlflow_run_id)
        return f"{run.info.artifact_uri}/{path}"
