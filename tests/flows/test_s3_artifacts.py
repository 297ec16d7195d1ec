"""MLflow artifacts (checkpoints, the logged model) on an S3 server (SeaweedFS): a run that fails
mid-way resumes from its S3 checkpoint and registers its final policy from there; credentials come
from the environment and are never logged; a wrong endpoint or credentials fail early, naming the
field to fix."""

import json
import os

import pytest
from mlflow.tracking import MlflowClient

import outage_env  # tests/flows is on sys.path
from agentgym.config import TrackingConfig
from agentgym.tracking.tracker import ArtifactStoreError, Tracker
from configs import parse_tiny_config  # tests/ is on sys.path


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The server's credentials in the environment (where MLflow's S3 client reads them)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server["secret"])
    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", "")  # restored after the test (config sets it)
    return s3_server


def _tracking(tmp_path, s3, **extra) -> dict:
    return {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "s3-artifacts",
            "artifact_location": f"s3://{s3['bucket']}/mlflow", "s3_endpoint_url": s3["endpoint_url"], **extra}


def test_resume_from_an_s3_checkpoint_and_register_the_model(tmp_path, model_cache, s3_env, monkeypatch):
    from agentgym.registry.champion import materialize
    from flows.train import scaling_inter_rl

    s3 = s3_env
    cfg = parse_tiny_config(
        model_cache, store_root=tmp_path / "store", run_id="s3-run",
        envs=[{"name": "outage_env:OutageKeywordEnv", "tasks": [0, 1, 2, 3], "kwargs": {"target": "yes"}}],
        rollout={"max_new_tokens": 4}, algorithm={"skip_tied_groups": False},
        schedule={"stages": [{"horizon": 1, "iterations": 1}, {"horizon": 1, "iterations": 1}]},
        tracking=_tracking(tmp_path, s3, registered_model_name="s3-policy"))
    # first attempt: stage 0 (4 episodes) checkpoints to S3, then the environment goes down
    outage_env.reset_counter()
    monkeypatch.setenv("AGENTGYM_TEST_OUTAGE_AFTER", "4")
    with pytest.raises(Exception, match="infra"):
        scaling_inter_rl(cfg)
    client = MlflowClient(cfg.tracking.tracking_uri)
    exp = client.get_experiment_by_name("s3-artifacts")
    assert exp.artifact_location == f"s3://{s3['bucket']}/mlflow/s3-artifacts"
    first = Tracker.from_config(cfg.tracking).latest_checkpoint("s3-run")
    assert first.global_step == 1 and first.artifact_uri.startswith(f"s3://{s3['bucket']}/mlflow/")
    import s3fs

    fs = s3fs.S3FileSystem(**s3["storage_options"])
    stored = fs.find(f"{s3['bucket']}/mlflow")
    assert any(p.endswith("checkpoints/step-000001/config.json") for p in stored), stored
    assert not any("mlartifacts" in str(p) for p in tmp_path.rglob("*") if p.is_file()), "artifacts stayed local"

    # second attempt, same run id: restores the step-1 checkpoint from S3, trains stage 1
    monkeypatch.delenv("AGENTGYM_TEST_OUTAGE_AFTER")
    result = scaling_inter_rl(cfg)
    assert result["resumed_from_step"] == 1
    assert [s["stage"] for s in result["stages"]] == [0, 1]
    assert result["stages"][-1]["checkpoint"].startswith("s3://") and "step-000002" in result["stages"][-1]["checkpoint"]
    # the final policy: a logged model on S3, registered, and loadable from the registry
    registry = MlflowClient(cfg.tracking.tracking_uri, registry_uri=cfg.tracking.tracking_uri)
    (mv,) = registry.search_model_versions("name = 's3-policy'")
    assert mv.source.startswith(f"s3://{s3['bucket']}/mlflow/s3-artifacts/") and mv.run_id == result["mlflow_run_id"]
    folder = materialize("models:/s3-policy/1", cfg.tracking.tracking_uri, tmp_path / "fresh-cache")
    assert (folder / "config.json").is_file() and str(folder).startswith(str(tmp_path / "fresh-cache"))

    # the credentials are nowhere in MLflow: params, tags, the config artifact
    parent = client.get_run(result["mlflow_run_id"])
    logged = json.dumps([parent.data.params, parent.data.tags,
                         json.loads(open(client.download_artifacts(parent.info.run_id, "config.json",
                                                                   str(tmp_path))).read())])
    assert s3["secret"] not in logged and s3["key"] not in logged


def test_bad_credentials_name_the_fix(tmp_path, s3_env, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(ArtifactStoreError, match="credentials were refused: check AWS_ACCESS_KEY_ID"):
        Tracker.from_config(TrackingConfig(**_tracking(tmp_path, s3_env)))


def test_an_unreachable_endpoint_names_the_field(tmp_path, monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", "")
    cfg = TrackingConfig(tracking_uri=f"sqlite:///{tmp_path}/m.db", artifact_location="s3://bucket/mlflow",
                         s3_endpoint_url=f"http://127.0.0.1:{port}")
    with pytest.raises(ArtifactStoreError, match=r"cannot reach the S3 endpoint.*tracking\.s3_endpoint_url"):
        Tracker.from_config(cfg)
    assert not MlflowClient(cfg.tracking_uri).get_experiment_by_name(cfg.experiment)  # nothing created


def test_an_experiment_keeps_its_artifact_location(tmp_path):
    uri = f"sqlite:///{tmp_path}/m.db"
    Tracker(uri, "exp")  # created beside the DB
    with pytest.raises(ArtifactStoreError, match="use a new tracking.experiment name"):
        Tracker.from_config(TrackingConfig(tracking_uri=uri, experiment="exp",
                                           artifact_location=str(tmp_path / "elsewhere")))
