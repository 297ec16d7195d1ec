"""One rule names every Prefect artifact (agentgym.artifact_keys)."""

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
