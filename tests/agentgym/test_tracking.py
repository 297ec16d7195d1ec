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


# -- what a user sees in the MLflow UI ---------------------------------------------------------------

def test_experiment_is_made_for_training_runs_with_a_description(tmp_path):
    from agentgym.tracking.tracker import EXPERIMENT_DESCRIPTION, NOTE

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tags = Tracker(uri, "exp").client.get_experiment_by_name("exp").tags
    assert tags["mlflow.experimentKind"] == "custom_model_development"
    assert tags[NOTE] == EXPERIMENT_DESCRIPTION and "stage<i>-h<horizon>" in tags[NOTE]
    # an experiment made before the tags existed gets them, and a description a user wrote stays
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    old = client.create_experiment("old")
    client.set_experiment_tag(old, NOTE, "my notes")
    Tracker(uri, "old")
    tags = client.get_experiment(old).tags
    assert tags[NOTE] == "my notes" and tags["mlflow.experimentKind"] == "custom_model_development"


def test_run_names_show_stage_and_horizon_first_and_links_open_the_training_view(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "exp", ui_url="http://127.0.0.1:5000")
    parent = tracker.pipeline_run("20261206-030900-abcdef", {"seed": 0})
    child = tracker.stage_run(parent, "20261206-030900-abcdef", 2, 4, 6)
    run = tracker.client.get_run(child)
    # the runs table cuts long names: what is shown first must say which stage
    assert run.info.run_name == "stage2-h4 20261206-030900-abcdef"
    assert run.data.tags["agentgym.run_id"] == "20261206-030900-abcdef"
    assert tracker.stage_run(parent, "20261206-030900-abcdef", 2, 4, 6) == child  # found again by its tags
    # MLflow 3.17's UI opens an experiment in its GenAI view unless the URL asks for the classic one
    assert tracker.run_url(child).endswith(f"/#/experiments/{tracker.experiment_id}/runs/{child}"
                                           "?workflowType=machine_learning")
    assert tracker.experiment_url().endswith("/runs?workflowType=machine_learning")


def test_model_metrics_are_linked_once_without_doubling_the_run_history(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "exp")
    run = tracker.pipeline_run("r", {"seed": 0})
    tracker.log_metrics(run, {"heldout/greedy_at_1": 0.25, "heldout/random_valid": 0.2}, step=0)
    tracker.log_metrics(run, {"heldout/greedy_at_1": 0.75, "heldout/random_valid": 0.2, "reward_mean": 1.0}, step=24)
    model = tracker.client.create_logged_model(tracker.experiment_id, name="policy", source_run_id=run)
    assert sorted(tracker.link_model_metrics(run, model.model_id, "heldout/", step=24)) == [
        "heldout/greedy_at_1", "heldout/random_valid"]
    assert tracker.link_model_metrics(run, model.model_id, "heldout/", step=24) == []  # a resume: nothing again
    linked = {m.key: (m.step, m.value) for m in tracker.client.get_logged_model(model.model_id).metrics}
    assert linked == {"heldout/greedy_at_1": (24, 0.75), "heldout/random_valid": (24, 0.2)}
    assert [(m.step, m.value) for m in tracker.client.get_metric_history(run, "heldout/greedy_at_1")] == [
        (0, 0.25), (24, 0.75)]


def test_experiment_kind_through_the_rest_api_of_a_real_server(tmp_path):
    """What the MLflow UI reads: the experiment's tags as a tracking server serves them."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path}/mlflow.db", "--default-artifact-root", str(tmp_path / "art")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise AssertionError("mlflow server did not start") from None
                time.sleep(0.5)
        Tracker(base, "served").pipeline_run("r", {"seed": 0})
        with urllib.request.urlopen(f"{base}/api/2.0/mlflow/experiments/get-by-name?experiment_name=served") as r:
            tags = {t["key"]: t["value"] for t in json.load(r)["experiment"]["tags"]}
        assert tags["mlflow.experimentKind"] == "custom_model_development"
        assert tags["mlflow.note.content"].startswith("AgentGym-RL training runs")
    finally:
        import os
        import signal

        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
