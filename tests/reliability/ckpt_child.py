"""The process a checkpoint test SIGKILLs: it logs checkpoints of steps 1..N to an MLflow stage run
with the real ``Tracker.log_checkpoint``, and kills itself (``SIGKILL``, no cleanup of any kind)
at a chosen point of the last one. Run in a forked child (tests/reliability/test_checkpoint_kill.py).

Kill points, in the order a save passes them:

* ``before_upload``: the export is done, no file has reached the artifact store;
* ``mid_upload``: half of ``model.safetensors`` copied into the artifact store (a torn file in a
  partial folder);
* ``before_tags``: every file and ``agentgym_checkpoint.json`` uploaded, no tag set;
* ``between_tags``: one tag write done, the next not (with tags set one by one, the new folder
  was paired with the old step).
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

from mlflow.tracking import MlflowClient

from checkpoints import stage_run

KILL_POINTS = ("before_upload", "mid_upload", "before_tags", "between_tags")
#: an SFT epoch checkpoint is published by one tag (``agentgym.sft_epoch_checkpoint``): no "between"
SFT_KILL_POINTS = ("before_upload", "mid_upload", "before_tags")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(kill_at: str) -> None:
    """Patch this process so that it dies at ``kill_at`` of the next checkpoint."""
    if kill_at == "before_upload":
        real_upload = MlflowClient.log_artifacts

        def upload(self, *a, **kw):
            _die()
            return real_upload(self, *a, **kw)

        MlflowClient.log_artifacts = upload
    elif kill_at == "mid_upload":
        real_copy = shutil.copy2  # what MLflow's local artifact store copies each file with

        def copy2(src, dst, *a, **kw):
            if Path(src).name == "model.safetensors":
                data = Path(src).read_bytes()
                Path(dst).write_bytes(data[: len(data) // 2])
                _die()
            return real_copy(src, dst, *a, **kw)

        shutil.copy2 = copy2
    elif kill_at in ("before_tags", "between_tags"):
        writes = {"n": 0}
        die_at = 1 if kill_at == "before_tags" else 2
        real_tag, real_batch = MlflowClient.set_tag, MlflowClient.log_batch

        def counted(real):
            def write(self, run_id, *a, **kw):
                if real is real_batch and not kw.get("tags"):
                    return real(self, run_id, *a, **kw)  # metrics/params only: not a tag write
                writes["n"] += 1
                if writes["n"] == die_at:
                    _die()
                return real(self, run_id, *a, **kw)
            return write

        MlflowClient.set_tag, MlflowClient.log_batch = counted(real_tag), counted(real_batch)
    else:
        raise ValueError(f"unknown kill point {kill_at!r}; one of {KILL_POINTS}")


def log_checkpoints(db_dir: str, folders: list[str], first_step: int, kill_at: str | None) -> None:
    """Log ``folders`` as the checkpoints of steps ``first_step``, ``first_step + 1``, ...; with
    ``kill_at``, die there during the last one."""
    tracker, stage = stage_run(Path(db_dir))
    for i, folder in enumerate(folders):
        step = first_step + i
        if kill_at and i == len(folders) - 1:
            _arm(kill_at)
        tracker.log_checkpoint(stage, folder, step, meta={"run_id": "ckpt", "stage": 0, "policy_version": step})


def sft_run(db_dir: str | Path) -> tuple:
    """A tracker on ``db_dir``'s DB and the SFT run of pipeline ``ckpt`` (found again by a re-run)."""
    from agentgym.tracking.tracker import Tracker

    tracker = Tracker(f"sqlite:///{db_dir}/mlflow.db", "reliability")
    parent = tracker.pipeline_run("ckpt", {"run_id": "ckpt"})
    return tracker, tracker.sft_run(parent, "ckpt", {"epochs": 4})


def log_sft_epochs(db_dir: str, folders: list[str], first_epoch: int, kill_at: str | None) -> None:
    """Log ``folders`` as the SFT epoch checkpoints of epochs ``first_epoch``, ... with the real
    ``Tracker.log_sft_epoch_checkpoint`` (what ``tasks/sft.py`` calls after each epoch); with
    ``kill_at``, die there during the last one."""
    tracker, run = sft_run(db_dir)
    for i, folder in enumerate(folders):
        if kill_at and i == len(folders) - 1:
            _arm(kill_at)
        tracker.log_sft_epoch_checkpoint(run, folder, first_epoch + i)


#: kill points of a checkpoint upload to S3 (``tests/reliability/test_s3_checkpoint_kill.py``)
S3_KILL_POINTS = ("mid_upload", "before_tags")


def _arm_s3(kill_at: str) -> None:
    """As ``_arm``, for MLflow's S3 artifact repository: at ``mid_upload`` the process dies while
    ``model.safetensors`` is being uploaded, after half of it reached the store as that object
    (the other files uploaded so far stay: a partial ``step-N`` prefix)."""
    if kill_at != "mid_upload":
        return _arm(kill_at)
    from mlflow.store.artifact.s3_artifact_repo import S3ArtifactRepository

    real_upload = S3ArtifactRepository._upload_file

    def upload(self, s3_client, local_file, bucket, key):
        if key.endswith("/model.safetensors"):
            data = Path(local_file).read_bytes()
            s3_client.put_object(Bucket=bucket, Key=key, Body=data[: len(data) // 2])
            _die()
        return real_upload(self, s3_client, local_file, bucket, key)

    S3ArtifactRepository._upload_file = upload


def log_s3_checkpoints(env: dict[str, str], location: str, db_dir: str, folders: list[str], first_step: int,
                       kill_at: str | None) -> None:
    """``log_checkpoints`` into an S3 artifact store at ``location`` (endpoint and credentials in
    ``env``: a fork-server child has the server's environment, not the test's)."""
    os.environ.update(env)
    tracker, stage = stage_run(Path(db_dir), artifact_location=location)
    for i, folder in enumerate(folders):
        step = first_step + i
        if kill_at and i == len(folders) - 1:
            _arm_s3(kill_at)
        tracker.log_checkpoint(stage, folder, step, meta={"run_id": "ckpt", "stage": 0, "policy_version": step})
