"""Rules defined once: Prefect artifact keys (agentgym.tracking.artifact_keys), a run's store location."""

from pathlib import Path

from agentgym.tracking.artifact_keys import MAX_KEY_CHARS, artifact_key

ROOT = Path(__file__).resolve().parents[2]


def test_key_rule():
    assert artifact_key("stage", 0, "My_Run.v2") == "stage-0-my-run-v2"
    assert artifact_key("eval", None, "--a__b--") == "eval-a-b"
    assert artifact_key("!!!") == "artifact"
    long = artifact_key("heldout", "x" * 300)
    assert len(long) == MAX_KEY_CHARS and long.startswith("heldout-x")
    assert not artifact_key("a", "-" * 98 + "b" * 5).endswith("-")


def test_no_hand_built_keys():
    """Flows and tasks name artifacts through artifact_key only (two rules once drifted apart)."""
    offenders = [str(p.relative_to(ROOT)) for folder in ("flows", "tasks", "agentgym")
                 for p in (ROOT / folder).rglob("*.py")
                 if 'replace("_", "-")' in p.read_text() and p.name != "artifact_keys.py"]
    assert not offenders, offenders


def test_store_location_is_built_in_one_place():
    """A run's store path comes from TrajectoryStore.location, as the store itself lays it out."""
    from agentgym.store.trajectory_store import TrajectoryStore

    store = TrajectoryStore("/tmp/x-root/", "run-1")
    assert TrajectoryStore.location("/tmp/x-root/", "run-1", "episodes") == store.path("episodes")
    assert TrajectoryStore.location("s3://b/p", "r") == "s3://b/p/r"
    offenders = [str(p.relative_to(ROOT)) for folder in ("flows", "tasks", "agentgym")
                 for p in (ROOT / folder).rglob("*.py") if "store.root.rstrip" in p.read_text()]
    assert not offenders, offenders


def test_flows_and_tasks_reach_mlflow_through_the_tracker():
    """MLflow is called through agentgym.tracking.tracker.Tracker's methods, not its raw client."""
    offenders = [str(p.relative_to(ROOT)) for folder in ("flows", "tasks")
                 for p in (ROOT / folder).rglob("*.py") if "tracker.client." in p.read_text()]
    assert not offenders, offenders


def test_tracker_run_helpers(tmp_path):
    from agentgym.tracking.tracker import TAG_KIND, Tracker

    tracker = Tracker(f"sqlite:///{tmp_path}/m.db", "helpers")
    rid = tracker.open_run("evaluation", "eval-x", {"agentgym.model": "m"}, {"k": 4, "long": "x" * 7000})
    run = tracker.client.get_run(rid)
    assert run.data.tags[TAG_KIND] == "evaluation" and run.data.tags["agentgym.model"] == "m"
    assert run.data.params["k"] == "4" and len(run.data.params["long"]) == 6000
    for step, value in ((2, 0.5), (0, 0.1), (1, 0.3)):
        tracker.log_metrics(rid, {"score": value}, step=step)
    assert tracker.metric_steps(rid, "score") == [(0, 0.1), (1, 0.3), (2, 0.5)]
    assert tracker.last_metrics(rid)["score"] == 0.5
    tracker.log_json(rid, {"a": 1}, "reports/r.json")
    assert tracker.load_dict(rid, "reports/r.json") == {"a": 1}
    assert tracker.artifact_uri(rid, "reports/r.json").endswith(f"{rid}/artifacts/reports/r.json")
    tracker.end_run(rid, "FAILED")
    assert tracker.client.get_run(rid).info.status == "FAILED"
