"""MLflow tracking: a parent run per pipeline run, a child run per ScalingInter-RL stage.

Runs are found again by tags (``agentgym.run_id``, ``agentgym.stage``), so re-running a
pipeline with the same run id reuses its MLflow runs instead of creating new ones. Everything
goes through ``MlflowClient`` with explicit run ids: the fluent API keeps an active-run stack
per thread, which Prefect's task threads would get wrong.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunStatus, RunTag
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
from mlflow.types import ColSpec, DataType, Schema
from mlflow.types.schema import Array

from agentgym.config import TrackingConfig
from agentgym.infra.diskspace import disk_errors
from agentgym.store.schema import SCHEMAS
from agentgym.tracking.metric_history import metric_history
from agentgym.tracking.db_full import guarded
from agentgym.tracking.open_client import open_client

log = logging.getLogger(__name__)

TAG_RUN = "agentgym.run_id"
TAG_KIND = "agentgym.kind"
TAG_STAGE = "agentgym.stage"
TAG_DONE = "agentgym.stage_finished"
TAG_CKPT = "agentgym.last_checkpoint"
TAG_CKPT_STEP = "agentgym.last_checkpoint_step"
TAG_SFT_EPOCH = "agentgym.sft_epoch_checkpoint"
# config fields that may change when a run is resumed (they do not change what is trained)
RESUME_MUTABLE = ("run_id", "tracking.", "store.storage_options", "rollout.env_workers")


NOTE = "mlflow.note.content"  # the description of a run, an experiment or a logged model in the MLflow UI
DEFAULT_UI_URL = "http://127.0.0.1:5000"  # where `mlflow ui` serves by default
# MLflow 3's UI opens an experiment in its GenAI view (a traces overview) unless the page's URL
# says otherwise; these are training runs, so every link this project writes opens the classic
# view. The experiment tag says the same to UIs that read it (MLflow 3.17 decides by the URL).
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
CLASSIC_VIEW = "workflowType=machine_learning"
EXPERIMENT_DESCRIPTION = (
    "AgentGym-RL training runs (`agentgym train`, the `scaling-inter-rl` flow). Each pipeline run is a "
    "parent run named by its run id; its child runs are the ScalingInter-RL stages, named "
    "`stage<i>-h<horizon> <run id>` (and `sft <run id>` for a warm start).\n\n"
    "- stage runs: per-iteration metrics with step = global step; `learning/` charts the headline "
    "series (success, reward, turns, format errors), `time/` where the iteration's time went; "
    "checkpoints under `checkpoints/`.\n"
    "- pipeline run: the same per-iteration metrics over all stages, `heldout/greedy_at_1` (held-out "
    "success of the policy at each stage's end, step = global step) beside `heldout/random_valid`, "
    "`heldout-by-policy/` for each evaluated policy's details (`<policy>.<env>.<category>.<metric>`), the "
    "logged model `policy`, the trajectory "
    "viewer and the learning curve.")


class ResumeConflict(ValueError):
    """A run id was reused with a config that trains something else."""


class ArtifactStoreError(RuntimeError):
    """The configured MLflow artifact store cannot be used (unreachable, bad credentials, ...)."""


_probed: set[tuple[str, str | None, str]] = set()
_probe_lock = threading.Lock()


def experiment_artifact_location(cfg: TrackingConfig) -> str | None:
    """Where a new experiment of ``cfg`` keeps its artifacts: ``<artifact_location>/<experiment>``
    (a local folder as a file:// URI), beside a SQLite DB, or None (the server's default)."""
    root = cfg.artifact_location
    if not root:
        return default_artifact_location(cfg.tracking_uri, cfg.experiment)
    if "://" not in root:
        root = Path(root).expanduser().resolve().as_uri()
    return f"{root.rstrip('/')}/{cfg.experiment}"


def configure_artifact_store(cfg: TrackingConfig) -> None:
    """Make an ``s3://`` ``tracking.artifact_location`` usable by MLflow in this process, and
    check it once (write and delete a small object), so a wrong endpoint or credentials fail now
    with the field to fix instead of at the first checkpoint.

    MLflow's S3 client reads its endpoint from ``MLFLOW_S3_ENDPOINT_URL`` and its credentials
    from the standard AWS chain (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``):
    ``tracking.s3_endpoint_url`` is copied to that variable (process-wide); credentials are never
    read from the config (it is logged to MLflow and stored by Prefect), only from the environment.
    """
    loc = cfg.artifact_location
    if not loc or not loc.startswith("s3://"):
        return
    if cfg.s3_endpoint_url:
        os.environ["MLFLOW_S3_ENDPOINT_URL"] = cfg.s3_endpoint_url
    endpoint = os.environ.get("MLFLOW_S3_ENDPOINT_URL") or None
    # checked once per location, endpoint and credentials (a digest: the secret is kept nowhere)
    who = hashlib.sha256("\0".join(os.environ.get(k, "") for k in (
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")).encode()).hexdigest()
    with _probe_lock:
        if (loc, endpoint, who) in _probed:
            return
        _probe_s3(loc, endpoint)
        _probed.add((loc, endpoint, who))


def _probe_s3(location: str, endpoint: str | None) -> None:
    import boto3
    import botocore.exceptions as bx
    from botocore.config import Config

    bucket, _, prefix = location[len("s3://"):].partition("/")
    where = f"tracking.artifact_location={location}" + (f" at {endpoint}" if endpoint else "")
    # a fresh session: boto3's default one keeps the credentials it resolved first
    client = boto3.session.Session().client("s3", endpoint_url=endpoint, config=Config(
        connect_timeout=5, read_timeout=10, retries={"max_attempts": 1}))
    key = f"{prefix.strip('/') + '/' if prefix.strip('/') else ''}.agentgym-probe"
    try:
        client.put_object(Bucket=bucket, Key=key, Body=b"agentgym artifact store check")
        client.delete_object(Bucket=bucket, Key=key)
    except (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError) as e:
        raise ArtifactStoreError(
            f"{where}: cannot reach the S3 endpoint ({type(e).__name__}); start the S3 server, or fix "
            "tracking.s3_endpoint_url (or MLFLOW_S3_ENDPOINT_URL)") from None
    except bx.NoCredentialsError:
        raise ArtifactStoreError(
            f"{where}: no S3 credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
            "AWS_PROFILE) in the environment of the process that runs the flow") from None
    except bx.ClientError as e:
        code = e.response.get("Error", {}).get("Code", "?")
        if code in ("NoSuchBucket", "404"):
            fix = f"create bucket {bucket!r}, or point tracking.artifact_location at an existing one"
        elif code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "InvalidToken"):
            fix = ("the credentials were refused: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or "
                   "AWS_PROFILE) in the environment, and that they may write to the bucket")
        else:
            fix = "check tracking.artifact_location, tracking.s3_endpoint_url and the AWS credentials"
        raise ArtifactStoreError(f"{where}: S3 answered {code}; {fix}") from None


def mlflow_schema(table: str) -> str:
    """The store table's Arrow schema as an MLflow dataset schema (``{"mlflow_colspec": ...}``),
    which the MLflow UI shows beside a run's dataset input."""
    def dtype(t: pa.DataType):
        if pa.types.is_list(t):
            return Array(dtype(t.value_type))
        if pa.types.is_boolean(t):
            return DataType.boolean
        if pa.types.is_int64(t):
            return DataType.long
        if pa.types.is_integer(t):
            return DataType.integer
        if pa.types.is_float32(t):
            return DataType.float
        if pa.types.is_floating(t):
            return DataType.double
        if pa.types.is_timestamp(t):
            return DataType.datetime
        return DataType.string

    schema = Schema([ColSpec(dtype(f.type), f.name, required=not f.nullable) for f in SCHEMAS[table]])
    return json.dumps({"mlflow_colspec": schema.to_dict()})


@dataclass
class CheckpointRef:
    artifact_uri: str
    global_step: int  # iterations completed when it was taken
    stage_run_id: str
    meta: dict[str, Any]


#: config keys whose values are credentials, never logged (params, config.json): shown as "***".
#: Exact names, and suffixes after an underscore (``aws_session_token``, ``api_key``); plain
#: substrings would also hide ``max_new_tokens``.
SECRET_KEYS = frozenset({"key", "secret", "token", "password", "passwd", "credentials", "api_key",
                         "access_key", "secret_key", "access_key_id", "secret_access_key"})
SECRET_SUFFIXES = ("_secret", "_token", "_password", "_passwd", "_credentials", "_api_key", "_access_key",
                   "_secret_key", "_access_key_id", "_secret_access_key")


def redact_secrets(d: Any) -> Any:
    """``d`` with every value under a credential-like key (``SECRET_KEYS``, ``SECRET_SUFFIXES``;
    s3fs names the access key id ``key``) replaced by ``"***"``, recursively. The config is
    logged to MLflow for everyone who can read the experiment; credentials belong in the
    environment (``AWS_ACCESS_KEY_ID`` ...), and where a config holds some anyway they stay out."""
    if isinstance(d, dict):
        return {k: "***" if _is_secret_key(str(k)) and v not in (None, "") else redact_secrets(v)
                for k, v in d.items()}
    if isinstance(d, list):
        return [redact_secrets(v) for v in d]
    return d


def _is_secret_key(key: str) -> bool:
    k = key.lower()
    return k in SECRET_KEYS or k.endswith(SECRET_SUFFIXES)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, dict)) else str(v)
    return out


def stage_run_name(run_id: str, index: int, horizon: int) -> str:
    """A stage run's name: stage and horizon first, so the runs table (which cuts long names)
    shows them; the run id is also the tag ``agentgym.run_id``."""
    return f"stage{index}-h{horizon} {run_id}"


def default_artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """For a SQLite store, keep artifacts beside the database (``<db dir>/mlartifacts/<exp>``)
    rather than in ``./mlruns`` of whatever directory the process runs in; None otherwise."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    db = Path(tracking_uri[len("sqlite:///"):]).expanduser().resolve()
    return (db.parent / "mlartifacts" / experiment).as_uri()


class Tracker:
    def __init__(self, tracking_uri: str, experiment: str, artifact_location: str | None = None,
                 ui_url: str | None = None):
        """``artifact_location``: of the experiment when this creates it (None: beside a SQLite DB,
        else the server's default); given and different from an existing experiment's: an error."""
        self.uri = tracking_uri
        self.ui_url = ui_url
        # a full SQLite DB is reported as ENOSPC naming tracking.tracking_uri (tracking_db.py)
        # a fresh SQLite DB another process is creating too: retried (open_client.py)
        self.client = guarded(open_client(tracking_uri), tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            self.experiment_id = self.client.create_experiment(
                experiment, artifact_location=artifact_location or default_artifact_location(tracking_uri, experiment),
                tags={EXPERIMENT_KIND[0]: EXPERIMENT_KIND[1], NOTE: EXPERIMENT_DESCRIPTION})
        else:
            self.experiment_id = exp.experiment_id
            # an experiment made before these tags existed gets them; a description a user wrote stays
            for key, value in ((EXPERIMENT_KIND[0], EXPERIMENT_KIND[1]), (NOTE, EXPERIMENT_DESCRIPTION)):
                if key not in exp.tags:
                    self.client.set_experiment_tag(self.experiment_id, key, value)
            if artifact_location and exp.artifact_location.rstrip("/") != artifact_location.rstrip("/"):
                raise ArtifactStoreError(
                    f"experiment {experiment!r} already keeps its artifacts at {exp.artifact_location}, so "
                    f"tracking.artifact_location cannot put them at {artifact_location}; use a new "
                    "tracking.experiment name for the new location, or drop tracking.artifact_location")

    @classmethod
    def from_config(cls, cfg: TrackingConfig) -> "Tracker":
        """The tracker of a config's ``tracking`` section (its artifact store checked and set up)."""
        configure_artifact_store(cfg)
        explicit = experiment_artifact_location(cfg) if cfg.artifact_location else None
        return cls(cfg.tracking_uri, cfg.experiment, artifact_location=explicit, ui_url=cfg.ui_url)

    def _find(self, **tags: str) -> str | None:
        filt = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        runs = self.client.search_runs([self.experiment_id], filter_string=filt, max_results=1,
                                       order_by=["attributes.start_time DESC"])
        return runs[0].info.run_id if runs else None

    def pipeline_run(self, run_id: str, config: dict[str, Any]) -> str:
        """The parent run of pipeline ``run_id`` (created, with the config as params, once)."""
        found = self._find(**{TAG_RUN: run_id, TAG_KIND: "pipeline"})
        if found:
            self._check_same_config(found, run_id, flatten(redact_secrets(config)))
            self.client.update_run(found, status="RUNNING")
            return found
        run = self.client.create_run(self.experiment_id, run_name=run_id,
                                     tags={TAG_RUN: run_id, TAG_KIND: "pipeline"})
        config = redact_secrets(config)
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
            self.experiment_id, run_name=stage_run_name(run_id, index, horizon),
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
        return self._done(found) if found else False

    def _done(self, stage_run_id: str) -> bool:
        return self.client.get_run(stage_run_id).data.tags.get(TAG_DONE) == "true"

    def run_link(self, mlflow_run_id: str) -> str:
        """Markdown pointing at the run in the MLflow UI: a link for a tracking server, the
        ``mlflow ui`` command for a local store."""
        if self.uri.startswith(("http://", "https://")):
            url = f"{self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{mlflow_run_id}?{CLASSIC_VIEW}"
            return f"[MLflow run {mlflow_run_id}]({url})"
        return f"MLflow run `{mlflow_run_id}` (open with `mlflow ui --backend-store-uri {self.uri}`)"

    def run_url(self, mlflow_run_id: str) -> str:
        """The run's page in the MLflow UI: ``tracking.ui_url``, else the tracking server, else
        where ``mlflow ui`` serves by default."""
        return f"{self._ui_base()}/#/experiments/{self.experiment_id}/runs/{mlflow_run_id}?{CLASSIC_VIEW}"

    def experiment_url(self) -> str:
        """The experiment's runs table in the MLflow UI (classic view), like :meth:`run_url`."""
        return f"{self._ui_base()}/#/experiments/{self.experiment_id}/runs?{CLASSIC_VIEW}"

    def _ui_base(self) -> str:
        """``tracking.ui_url``, else the tracking server, else where ``mlflow ui`` serves by default."""
        base = self.ui_url or (self.uri if self.uri.startswith(("http://", "https://")) else DEFAULT_UI_URL)
        return base.rstrip("/")

    def describe(self, mlflow_run_id: str, text: str) -> None:
        """The run's description (markdown) in the MLflow UI."""
        self.client.set_tag(mlflow_run_id, NOTE, text)

    def set_tags(self, mlflow_run_id: str, tags: dict[str, Any]) -> None:
        for k, v in tags.items():
            if v is not None:
                self.client.set_tag(mlflow_run_id, k, str(v))

    def finish_stage(self, stage_run_id: str) -> None:
        self.client.set_tag(stage_run_id, TAG_DONE, "true")
        self.client.set_terminated(stage_run_id, RunStatus.to_string(RunStatus.FINISHED))

    def open_run(self, kind: str, name: str, tags: dict[str, str], params: dict[str, Any]) -> str:
        """A new run of ``kind`` (evaluation, retrain, ...) with ``tags`` and ``params`` (values
        as text, cut at MLflow's 6000 characters); returns its id. End it with :meth:`end_run`."""
        run = self.client.create_run(self.experiment_id, run_name=name, tags={TAG_KIND: kind, **tags})
        for key, val in params.items():
            self.client.log_param(run.info.run_id, key, str(val)[:6000])
        return run.info.run_id

    def end_run(self, mlflow_run_id: str, status: str = "FINISHED") -> None:
        """Mark a run ``FINISHED`` or ``FAILED`` (a run must never stay RUNNING after its flow)."""
        self.client.set_terminated(mlflow_run_id, status)

    def finish_pipeline(self, parent: str, status: str = "FINISHED") -> None:
        self.end_run(parent, status)

    def logged_steps(self, mlflow_run_id: str, key: str = "reward_mean") -> set[int]:
        return {m.step for m in self.client.get_metric_history(mlflow_run_id, key)}

    def metric_steps(self, mlflow_run_id: str, key: str) -> list[tuple[int, float]]:
        """``(step, value)`` of ``key``, one per step (a redone step's last value), in step order."""
        return [(m.step, m.value) for m in metric_history(self.client, mlflow_run_id, key)]

    def last_metrics(self, mlflow_run_id: str) -> dict[str, float]:
        """The last value of every metric of a run."""
        return dict(self.client.get_run(mlflow_run_id).data.metrics)

    def artifact_uri(self, mlflow_run_id: str, path: str = "") -> str:
        """Where the run's artifact ``path`` lives (the run's artifact root for "")."""
        root = self.client.get_run(mlflow_run_id).info.artifact_uri.rstrip("/")
        return f"{root}/{path}" if path else root

    def log_file(self, mlflow_run_id: str, path: str | Path, folder: str | None = None) -> None:
        self.client.log_artifact(mlflow_run_id, str(path), folder)

    def log_json(self, mlflow_run_id: str, data: dict[str, Any], path: str) -> None:
        self.client.log_dict(mlflow_run_id, data, path)

    def log_metrics_once(self, mlflow_run_ids: list[str], metrics: dict[str, Any], step: int,
                         key: str = "reward_mean", again: bool = False) -> list[str]:
        """Log ``metrics`` at ``step`` to each run that has no ``key`` at that step yet.

        Each run is checked on its own: a process killed between logging the stage run and the
        pipeline run leaves the step on one of them only, and the resumed attempt must fill in
        the other without doubling the first (MLflow keeps every value logged at a step).
        ``again``: log to every run (the step was redone; its earlier values are superseded).
        Returns the runs that were written.
        """
        written = [r for r in mlflow_run_ids if again or step not in self.logged_steps(r, key)]
        for run in written:
            self.log_metrics(run, metrics, step)
        return written

    def log_metrics(self, mlflow_run_id: str, metrics: dict[str, Any], step: int) -> None:
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))]
        if batch:
            self.client.log_batch(mlflow_run_id, metrics=batch)

    def link_model_metrics(self, mlflow_run_id: str, model_id: str, prefix: str, step: int) -> list[str]:
        """Log the run's metrics named ``prefix...`` at ``step`` again, linked to logged model
        ``model_id`` (same value, step and timestamp), so the model's page in the MLflow UI shows
        them; once (those already linked are skipped). Returns the keys linked."""
        linked = {m.key for m in self.client.get_logged_model(model_id).metrics or []}
        keys = [k for k in self.client.get_run(mlflow_run_id).data.metrics
                if k.startswith(prefix) and k not in linked]
        batch = [Metric(k, m.value, m.timestamp, m.step, model_id=model_id)
                 for k in keys for m in self.client.get_metric_history(mlflow_run_id, k) if m.step == step]
        if batch:
            self.client.log_batch(mlflow_run_id, metrics=batch)
        return [m.key for m in batch]

    def log_checkpoint(self, mlflow_run_id: str, folder: str | Path, step: int,
                       meta: dict[str, Any] | None = None) -> str:
        """Upload an HF folder as ``checkpoints/step-XXXXXX``; returns its artifact URI."""
        path = f"checkpoints/step-{step:06d}"

        def write() -> None:
            self.client.log_artifacts(mlflow_run_id, str(folder), path)
            self.client.log_dict(mlflow_run_id, {"global_step": step, **(meta or {})},
                                 f"{path}/agentgym_checkpoint.json")

        dest = self._upload(mlflow_run_id, path, f"checkpoint step {step}", write)
        # The tags are what resume follows, so they are set last and together (one transaction):
        # set one by one, a kill between them paired the new folder with the old step.
        self.client.log_batch(mlflow_run_id, tags=[RunTag(TAG_CKPT, path), RunTag(TAG_CKPT_STEP, str(step))])
        return dest

    def _upload(self, mlflow_run_id: str, path: str, what: str, write: Callable[[], None]) -> str:
        """Run ``write`` (uploads to the run's artifact ``path``); returns the artifact URI. If it
        fails, what it left at ``path`` is removed (unless a checkpoint tag points there: then it
        was overwriting a checkpoint in use), and a full disk is reported as such."""
        run = self.client.get_run(mlflow_run_id)
        dest = f"{run.info.artifact_uri}/{path}"
        try:
            with disk_errors(what, dest, "free space in the MLflow artifact store (tracking."
                             "artifact_location), then re-run: it resumes from the previous checkpoint"):
                write()
        except Exception:
            tags = run.data.tags
            in_use = {tags.get(TAG_CKPT), tags.get(TAG_SFT_EPOCH) and f"sft/epoch-{int(tags[TAG_SFT_EPOCH]):02d}"}
            if path not in in_use:
                self._delete_artifacts(run.info.artifact_uri, path)
            raise
        return dest

    @staticmethod
    def _delete_artifacts(artifact_uri: str, path: str) -> None:
        """Best effort: remove a partly uploaded folder (no tag points at it, so it is unused)."""
        try:
            get_artifact_repository(artifact_uri).delete_artifacts(path)
        except Exception as e:  # noqa: BLE001 - the upload's own error is the one to report
            log.warning("could not remove the partial checkpoint %s/%s: %s", artifact_uri, path, e)

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

    def prune_checkpoint_subfolder(self, run_id: str, sub: str, keep: int) -> list[str]:
        """Delete ``sub`` (e.g. the trainer state) from every committed checkpoint of pipeline
        ``run_id`` but the newest ``keep``, across its stage runs; the checkpoints' weights stay.
        Committed: at or below the global step a stage run's checkpoint tag points at (a folder
        above it is a torn upload, which the re-run overwrites). Returns the artifact URIs removed.

        Called after a checkpoint is committed, so the state a resume loads is never removed; a
        deletion that fails is logged and skipped (the next call tries it again)."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (the newest checkpoint's {sub} is what a resume loads)")
        runs = self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`{TAG_RUN}` = '{run_id}' and tags.`{TAG_KIND}` = 'stage'")
        found: list[tuple[int, str, str]] = []  # (global step, artifact root URI, checkpoint path)
        for r in runs:
            committed = r.data.tags.get(TAG_CKPT_STEP)
            if committed is None:
                continue
            for ckpt in self.client.list_artifacts(r.info.run_id, "checkpoints"):
                step = int(ckpt.path.rsplit("-", 1)[1])
                # files under it, not the folder: an S3 server with directories (SeaweedFS) still
                # lists an emptied folder
                if step <= int(committed) and self.client.list_artifacts(r.info.run_id, f"{ckpt.path}/{sub}"):
                    found.append((step, r.info.artifact_uri, ckpt.path))
        removed = []
        for _, root, path in sorted(found, reverse=True)[keep:]:
            try:
                get_artifact_repository(root).delete_artifacts(f"{path}/{sub}")
            except Exception as e:  # noqa: BLE001 - the checkpoint is committed; training goes on
                log.warning("could not remove %s/%s/%s (it keeps its disk space until removed): %s",
                            root, path, sub, e)
                continue
            removed.append(f"{root}/{path}/{sub}")
        return removed

    def log_trajectory_commit(self, mlflow_run_id: str, table: str, stage: int, iteration: int,
                              source: str, digest: str, rows: int,
                              profile: dict[str, Any] | None = None) -> None:
        """Lineage: the iteration's committed trajectories as an MLflow dataset input, with the
        store table's schema and a profile (``num_rows`` and ``profile``'s numbers, e.g.
        ``success_rate``, ``reward_mean``)."""
        stats = {"num_rows": rows, **{k: v for k, v in (profile or {}).items()
                                      if isinstance(v, (int, float)) and math.isfinite(float(v))}}
        ds = Dataset(name=f"{table}/stage={stage}/iteration={iteration}", digest=digest[:36],
                     source_type="agentgym-trajectory-store",
                     source=json.dumps({"uri": source, "sha256": digest, "rows": rows}),
                     schema=mlflow_schema("episodes" if table == "demos" else table),
                     profile=json.dumps(stats))
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
            self.experiment_id, run_name=f"sft {run_id}",
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
        dest = self._upload(mlflow_run_id, path, f"SFT epoch {epoch} checkpoint",
                            lambda: self.client.log_artifacts(mlflow_run_id, str(folder), path))
        self.client.set_tag(mlflow_run_id, TAG_SFT_EPOCH, str(epoch))  # last: resume follows it
        return dest

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
