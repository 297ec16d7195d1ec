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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunStatus
from mlflow.tracking import MlflowClient

TAG_RUN = "agentgym.run_id"
TAG_KIND = "agentgym.kind"
TAG_STAGE = "agentgym.stage"
TAG_DONE = "agentgym.stage_finished"
TAG_CKPT = "agentgym.last_checkpoint"
TAG_CKPT_STEP = "agentgym.last_checkpoint_step"
TAG_SFT_EPOCH = "agentgym.sft_epoch_checkpoint"
# config fields that may change when a run is resumed (they do not change what is trained)
RESUME_MUTABLE = ("run_id", "tracking.", "store.storage_options", "rollout.env_workers")


class ResumeConflict(ValueError):
    """A run id was reused with a config that trains something else."""


@dataclass
class CheckpointRef:
    artifact_uri: str
    global_step: int  # iterations completed when it was taken
    stage_run_id: str
    meta: dict[str, Any]


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, dict)) else str(v)
    return out


def default_artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """For a SQLite store, keep artifacts beside the database (``<db dir>/mlartifacts/<exp>``)
    rather than in ``./mlruns`` of whatever directory the process runs in; None otherwise."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    db = Path(tracking_uri[len("sqlite:///"):]).expanduser().resolve()
    return (db.parent / "mlartifacts" / experiment).as_uri()


class Tracker:
    def __init__(self, tracking_uri: str, experiment: str):
        self.uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        self.experiment_id = exp.experiment_id if exp else self.client.create_experiment(
            experiment, artifact_location=default_artifact_location(tracking_uri, experiment))

    def _find(self, **tags: str) -> str | None:
        filt = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        runs = self.client.search_runs([self.experiment_id], filter_string=filt, max_results=1,
                                       order_by=["attributes.start_time DESC"])
        return runs[0].info.run_id if runs else None

    def pipeline_run(self, run_id: str, config: dict[str, Any]) -> str:
        """The parent run of pipeline ``run_id`` (created, with the config as params, once)."""
        found = self._find(**{TAG_RUN: run_id, TAG_KIND: "pipeline"})
        if found:
            self._check_same_config(found, run_id, flatten(config))
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

    def _check_same_config(self, mlflow_run_id: str, run_id: str, params: dict[str, str]) -> None:
        logged = self.client.get_run(mlflow_run_id).data.params
        diff = [k for k, v in params.items()
                if k in logged and logged[k] != v[:6000] and not k.startswith(RESUME_MUTABLE)]
        if diff:
            shown = ", ".join(f"{k}: {logged[k]!r} -> {params[k]!r}" for k in diff[:5])
            raise ResumeConflict(
                f"run {run_id!r} was started with a different config ({shown}); resume it with "
                "its original config, or start a new run (a new run_id)"
            )

    def stage_run(self, parent: str, run_id: str, index: int, horizon: int, iterations: int) -> str:
        found = self._find(**{TAG_RUN: run_id, TAG_KIND: "stage", TAG_STAGE: str(index)})
        if found:
            if not self._done(found):  # a failed or killed attempt: running again
                self.client.update_run(found, status="RUNNING")
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
        return bool(found) and self._done(found)

    def _done(self, stage_run_id: str) -> bool:
        return self.client.get_run(stage_run_id).data.tags.get(TAG_DONE) == "true"

    def run_link(self, mlflow_run_id: str) -> str:
        """Markdown pointing at the run in the MLflow UI: a link for a tracking server, the
        ``mlflow ui`` command for a local store."""
        if self.uri.startswith(("http://", "https://")):
            url = f"{self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{mlflow_run_id}"
            return f"[MLflow run {mlflow_run_id}]({url})"
        return f"MLflow run `{mlflow_run_id}` (open with `mlflow ui --backend-store-uri {self.uri}`)"

    def finish_stage(self, stage_run_id: str) -> None:
        self.client.set_tag(stage_run_id, TAG_DONE, "true")
        self.client.set_terminated(stage_run_id, RunStatus.to_string(RunStatus.FINISHED))

    def finish_pipeline(self, parent: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(parent, status)

    def logged_steps(self, mlflow_run_id: str, key: str = "reward_mean") -> set[int]:
        return {m.step for m in self.client.get_metric_history(mlflow_run_id, key)}

    def log_metrics_once(self, mlflow_run_ids: list[str], metrics: dict[str, Any], step: int,
                         key: str = "reward_mean") -> list[str]:
        """Log ``metrics`` at ``step`` to each run that has no ``key`` at that step yet.

        Each run is checked on its own: a process killed between logging the stage run and the
        pipeline run leaves the step on one of them only, and the resumed attempt must fill in
        the other without doubling the first (MLflow keeps every value logged at a step).
        Returns the runs that were written.
        """
        written = [r for r in mlflow_run_ids if step not in self.logged_steps(r, key)]
        for run in written:
            self.log_metrics(run, metrics, step)
        return written

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
        self.client.set_tag(mlflow_run_id, TAG_CKPT, path)
        self.client.set_tag(mlflow_run_id, TAG_CKPT_STEP, str(step))
        run = self.client.get_run(mlflow_run_id)
        return f"{run.info.artifact_uri}/{path}"

    def latest_checkpoint(self, run_id: str) -> CheckpointRef | None:
        """The checkpoint with the highest global step among the run's stage runs and its SFT
        run (whose finished policy is the step-0 checkpoint the RL stages start from)."""
        runs = self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`{TAG_RUN}` = '{run_id}'")
        best: CheckpointRef | None = None
        for r in runs:
            tags = r.data.tags
            if tags.get(TAG_KIND) not in ("stage", "sft") or TAG_CKPT_STEP not in tags:
                continue
            step = int(tags[TAG_CKPT_STEP])
            if best is None or step > best.global_step:
                uri = f"{r.info.artifact_uri}/{tags[TAG_CKPT]}"
                meta = self.client.download_artifacts(r.info.run_id, f"{tags[TAG_CKPT]}/agentgym_checkpoint.json")
                best = CheckpointRef(uri, step, r.info.run_id, json.loads(open(meta).read()))
        return best

    def log_trajectory_commit(self, mlflow_run_id: str, table: str, stage: int, iteration: int,
                              source: str, digest: str, rows: int) -> None:
        """Lineage: the iteration's committed trajectories as an MLflow dataset input."""
        ds = Dataset(name=f"{table}/stage={stage}/iteration={iteration}", digest=digest[:36],
                     source_type="agentgym-trajectory-store",
                     source=json.dumps({"uri": source, "sha256": digest, "rows": rows}))
        self.client.log_inputs(mlflow_run_id, datasets=[DatasetInput(ds, tags=[InputTag("mlflow.data.context", "training")])])

    # -- the SFT stage ----------------------------------------------------------------------
    def sft_run(self, parent: str, run_id: str, params: dict[str, Any]) -> str:
        """The child run of the SFT stage of pipeline ``run_id`` (found again by its tags)."""
        found = self._find(**{TAG_RUN: run_id, TAG_KIND: "sft"})
        if found:
            if not self._done(found):
                self.client.update_run(found, status="RUNNING")
            return found
        run = self.client.create_run(
            self.experiment_id, run_name=f"{run_id}-sft",
            tags={TAG_RUN: run_id, TAG_KIND: "sft", TAG_STAGE: "sft", "mlflow.parentRunId": parent})
        self.client.log_batch(run.info.run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])
        return run.info.run_id

    def find_run(self, run_id: str, kind: str) -> str | None:
        """The MLflow run of pipeline ``run_id`` of ``kind`` ("pipeline", "sft"; None: none yet)."""
        return self._find(**{TAG_RUN: run_id, TAG_KIND: kind})

    def run_checkpoint(self, mlflow_run_id: str) -> str | None:
        """Artifact URI of the last checkpoint logged to a stage or SFT run (None: none yet)."""
        run = self.client.get_run(mlflow_run_id)
        path = run.data.tags.get(TAG_CKPT)
        return f"{run.info.artifact_uri}/{path}" if path else None

    def is_finished(self, mlflow_run_id: str) -> bool:
        """Whether a stage or SFT run was marked finished (``finish_stage``)."""
        return self._done(mlflow_run_id)

    def log_sft_epoch_checkpoint(self, mlflow_run_id: str, folder: str | Path, epoch: int) -> str:
        """An HF folder after SFT epoch ``epoch`` (``sft/epoch-XX``): what a killed SFT stage
        resumes from. Not a pipeline checkpoint: ``latest_checkpoint`` ignores it."""
        path = f"sft/epoch-{epoch:02d}"
        self.client.log_artifacts(mlflow_run_id, str(folder), path)
        self.client.set_tag(mlflow_run_id, TAG_SFT_EPOCH, str(epoch))
        return f"{self.client.get_run(mlflow_run_id).info.artifact_uri}/{path}"

    def sft_epoch_checkpoint(self, mlflow_run_id: str) -> tuple[str, int] | None:
        """``(artifact URI, epoch)`` of the SFT run's last epoch checkpoint, if any."""
        run = self.client.get_run(mlflow_run_id)
        epoch = run.data.tags.get(TAG_SFT_EPOCH)
        if epoch is None:
            return None
        return f"{run.info.artifact_uri}/sft/epoch-{int(epoch):02d}", int(epoch)

    def has_artifact(self, mlflow_run_id: str, path: str) -> bool:
        folder, _, name = path.rpartition("/")
        return any(f.path == path for f in self.client.list_artifacts(mlflow_run_id, folder or None))

    def load_dict(self, mlflow_run_id: str, path: str) -> dict[str, Any]:
        return json.loads(Path(self.client.download_artifacts(mlflow_run_id, path)).read_text())
