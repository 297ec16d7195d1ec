"""`tracking.trainer_states_kept`: once a checkpoint is committed, the trainer state of older
checkpoints beyond the newest N is removed across the run's stage runs, their weights stay, and a
torn (uncommitted) folder above the committed step is left for the re-run to overwrite. On a
local artifact store and on a real S3 server (SeaweedFS)."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpoints import stage_run

STATE = "trainer_state"


@pytest.fixture(params=["local", "s3"])
def location(request, mlflow_dir) -> str:
    """Where the experiment keeps its artifacts: a folder, or a fresh prefix on SeaweedFS."""
    if request.param == "local":
        return (mlflow_dir / "artifacts").as_uri()
    return request.getfixturevalue("s3")["location"]


def _checkpoint(tmp: Path, step: int) -> Path:
    """A checkpoint folder: weights and a trainer-state sub-folder, both marked with ``step``."""
    folder = tmp / f"src-{step}"
    (folder / STATE).mkdir(parents=True)
    (folder / "model.safetensors").write_text(f"weights {step}")
    (folder / STATE / "mp_rank_00_model_states.pt").write_text(f"state {step}")
    return folder


def _states(tracker, *runs: str) -> dict[int, tuple[bool, bool]]:
    """Per checkpoint step of ``runs``, as the artifact store lists it: (weights, trainer state
    files). Files, not folders: SeaweedFS keeps listing a folder whose objects were deleted."""
    out = {}
    list_ = tracker.client.list_artifacts
    for run in runs:
        for ckpt in list_(run, "checkpoints"):
            files = {f.path.rsplit("/", 1)[1] for f in list_(run, ckpt.path)}
            out[int(ckpt.path.split("-")[1])] = ("model.safetensors" in files,
                                                 bool(list_(run, f"{ckpt.path}/{STATE}")))
    return out


def test_only_the_newest_states_are_kept_across_stage_runs(mlflow_dir, location):
    tracker, stage0 = stage_run(mlflow_dir, artifact_location=location)
    stage1 = tracker.stage_run(tracker.find_run("ckpt", "pipeline"), "ckpt", 1, horizon=2, iterations=3)
    for run, step in ((stage0, 1), (stage0, 2), (stage1, 3), (stage1, 4)):
        tracker.log_checkpoint(run, _checkpoint(mlflow_dir, step), step)
    # a torn upload: step 5's files under stage 1, its tag never set
    tracker.client.log_artifacts(stage1, str(_checkpoint(mlflow_dir, 5)), "checkpoints/step-000005")
    assert _states(tracker, stage0, stage1) == {s: (True, True) for s in range(1, 6)}

    removed = tracker.prune_checkpoint_subfolder("ckpt", STATE, keep=2)
    assert sorted(Path(u).parent.name for u in removed) == ["step-000001", "step-000002"]
    assert _states(tracker, stage0, stage1) == {1: (True, False), 2: (True, False), 3: (True, True),
                                                4: (True, True), 5: (True, True)}

    assert tracker.prune_checkpoint_subfolder("ckpt", STATE, keep=2) == []  # nothing more to do
    tracker.prune_checkpoint_subfolder("ckpt", STATE, keep=1)
    assert _states(tracker, stage0, stage1) == {1: (True, False), 2: (True, False), 3: (True, False),
                                                4: (True, True), 5: (True, True)}
    ref = tracker.latest_checkpoint("ckpt")  # what resume loads still has its state
    assert ref.global_step == 4 and ref.stage_run_id == stage1

    with pytest.raises(ValueError, match="keep must be >= 1"):
        tracker.prune_checkpoint_subfolder("ckpt", STATE, keep=0)


def test_another_runs_checkpoints_are_not_touched(mlflow_dir):
    tracker, mine = stage_run(mlflow_dir, artifact_location=(mlflow_dir / "artifacts").as_uri())
    _, other = stage_run(mlflow_dir, artifact_location=(mlflow_dir / "artifacts").as_uri(), run_id="other")
    for run, step in ((mine, 1), (mine, 2), (other, 1)):
        tracker.log_checkpoint(run, _checkpoint(mlflow_dir / ("m" if run == mine else "o"), step), step)
    tracker.prune_checkpoint_subfolder("ckpt", STATE, keep=1)
    assert _states(tracker, mine) == {1: (True, False), 2: (True, True)}
    assert _states(tracker, other) == {1: (True, True)}
