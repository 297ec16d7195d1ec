"""What the tracker writes to MLflow: never a credential from the config."""

import json

from agentgym.tracking.tracker import Tracker, redact_secrets


def test_redact_secrets_hides_credentials_at_any_depth():
    cfg = {"store": {"storage_options": {"key": "AKIA1", "secret": "s3cr3t", "token": "",
                                         "client_kwargs": {"endpoint_url": "http://x", "aws_session_token": "t"}}},
           "envs": [{"kwargs": {"api_password": "pw", "base_url": "http://y"}}], "seed": 0}
    out = redact_secrets(cfg)
    so = out["store"]["storage_options"]
    assert so["key"] == so["secret"] == so["client_kwargs"]["aws_session_token"] == "***"
    assert so["token"] == ""  # nothing to hide
    assert so["client_kwargs"]["endpoint_url"] == "http://x" and out["seed"] == 0
    keep = {"rollout": {"max_new_tokens": 12, "max_context_tokens": 2048}, "cache_dir": "~/.cache"}
    assert redact_secrets(keep) == keep  # names that merely contain "token" are not secrets
    assert out["envs"][0]["kwargs"] == {"api_password": "***", "base_url": "http://y"}
    assert cfg["store"]["storage_options"]["secret"] == "s3cr3t"  # the input is left alone


def test_pipeline_run_logs_no_credentials(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "redact")
    cfg = {"store": {"root": "s3://b/x", "storage_options": {"key": "AKIAXYZ", "secret": "hunter2"}}}
    run = tracker.pipeline_run("r1", cfg)
    params = tracker.client.get_run(run).data.params
    assert params["store.storage_options.secret"] == "***" and params["store.root"] == "s3://b/x"
    path = tracker.client.download_artifacts(run, "config.json", str(tmp_path))
    text = open(path).read()
    assert "hunter2" not in text and "AKIAXYZ" not in text
    assert json.loads(text)["store"]["storage_options"]["key"] == "***"
    assert tracker.pipeline_run("r1", cfg) == run  # resuming with the same config still matches
