"""Rules defined once: Prefect artifact keys (agentgym.artifact_keys), a run's store location."""

from pathlib import Path

from agentgym.artifact_keys import MAX_KEY_CHARS, artifact_key

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
    from agentgym.store import TrajectoryStore

    store = TrajectoryStore("/tmp/x-root/", "run-1")
    assert TrajectoryStore.location("/tmp/x-root/", "run-1", "episodes") == store.path("episodes")
    assert TrajectoryStore.location("s3://b/p", "r") == "s3://b/p/r"
    offenders = [str(p.relative_to(ROOT)) for folder in ("flows", "tasks", "agentgym")
                 for p in (ROOT / folder).rglob("*.py") if "store.root.rstrip" in p.read_text()]
    assert not offenders, offenders
