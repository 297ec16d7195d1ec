"""The learning curve read back from a real MLflow run: environment steps, stage ends, plot."""

import pytest

from agentgym.evaluation.learning_curve import from_mlflow, plot
from agentgym.tracking.tracker import Tracker


def test_curve_places_heldout_points_at_their_stage_ends(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "curve")
    run = tracker.pipeline_run("r1", {"seed": 0})
    # two stages of 2 iterations: 8 episodes of 2, 3, then 4, 5 turns
    for step, turns in enumerate([2.0, 3.0, 4.0, 5.0]):
        tracker.log_metrics(run, {"episodes": 8.0, "turns_per_episode": turns, "success_rate": 0.1 * step}, step=step)
    tracker.log_metrics(run, {"heldout/random-valid/overall/avg_at_1": 0.3, "heldout/base/overall/greedy_at_1": 0.1,
                              "heldout/stage-0/overall/greedy_at_1": 0.4,
                              "heldout/stage-1/overall/greedy_at_1": 0.7}, step=0)
    curve = from_mlflow(tracker.client, run, stage_ends=[2, 4])
    assert curve.env_steps == [16.0, 40.0, 72.0, 112.0]  # cumulative episodes x turns
    assert curve.train_success == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert curve.random_valid == 0.3
    assert [(p.label, p.success, p.env_steps) for p in curve.heldout] == [
        ("base", 0.1, 0.0), ("stage-0", 0.4, 40.0), ("stage-1", 0.7, 112.0)]
    assert all(m >= 0 for m in curve.minutes) and curve.minutes == sorted(curve.minutes)
    out = plot(curve, tmp_path / "c.png", "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_curve_of_a_run_without_heldout_is_empty_but_drawable(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "curve")
    run = tracker.pipeline_run("r2", {"seed": 0})
    curve = from_mlflow(tracker.client, run, stage_ends=[3])
    assert curve.heldout == [] and curve.env_steps == [] and curve.random_valid is None
    assert plot(curve, tmp_path / "empty.png", "empty").exists()
