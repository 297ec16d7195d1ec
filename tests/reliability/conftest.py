"""Fixtures of the reliability tests. Their helper modules (diskfull.py, checkpoints.py, ...)
sit beside them and are imported by name (this folder is on sys.path, as pytest puts it there)."""

from __future__ import annotations

import multiprocessing
import shutil
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # also for fork-server children (they get sys.path)


@pytest.fixture(scope="session")
def _mlflow_template(tmp_path_factory) -> Path:
    """An empty MLflow SQLite DB with its tables made: creating them runs every MLflow schema
    migration, which each test would otherwise repeat; copying the file skips them."""
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def mlflow_dir(tmp_path, _mlflow_template) -> Path:
    """``tmp_path`` holding a ready ``mlflow.db`` (``checkpoints.stage_run`` uses it)."""
    shutil.copy(_mlflow_template, tmp_path / "mlflow.db")
    return tmp_path


@pytest.fixture(scope="module")
def fork():
    """A fork server that imported MLflow, torch and transformers once: each checkpoint child
    (``ckpt_child``) starts in milliseconds instead of re-importing them."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["ckpt_child", "agentgym.tracking.tracker", "transformers"])
    return ctx


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The server's endpoint and credentials, in this process's environment and for children, and
    a fresh ``location`` (an s3:// prefix of its own) for the test's artifacts."""
    env = {"AWS_ACCESS_KEY_ID": s3_server["key"], "AWS_SECRET_ACCESS_KEY": s3_server["secret"],
           "MLFLOW_S3_ENDPOINT_URL": s3_server["endpoint_url"]}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return {**s3_server, "env": env, "location": f"s3://{s3_server['bucket']}/test-{uuid.uuid4().hex[:8]}"}
