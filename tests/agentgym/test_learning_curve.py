"""The learning curve read back from a real MLflow run: environment steps, stage ends, plot."""

import pytest

from agentgym.evaluation.learning_curve import from_mlflow, measured_seconds, plot, running_minutes
from agentgym.tracking.tracker import Tracker


@pytest.mark.parametrize("naming", [0, 1])  # today's naming, and runs logged before it
def test_curve_places_heldout_points_at_their_stage_ends(tmp_path, naming):
    from agentgym.evaluation.heldout_metrics import detail_keys

    def key(label: str, name: str) -> str:
        return detail_keys(label)[naming] + (name.replace("/", ".") if naming == 0 else name)

    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "curve")
    run = tracker.pipeline_run("r1", {"seed": 0})
    # two stages of 2 iterations: 8 episodes of 2, 3, then 4, 5 turns
    for step, turns in enumerate([2.0, 3.0, 4.0, 5.0]):
        tracker.log_metrics(run, {"episodes": 8.0, "turns_per_episode": turns, "success_rate": 0.1 * step}, step=step)
    tracker.log_metrics(run, {key("random-valid", "overall/avg_at_1"): 0.3, key("base", "overall/greedy_at_1"): 0.1,
                              key("stage-0", "overall/greedy_at_1"): 0.4,
                              key("stage-1", "overall/greedy_at_1"): 0.7}, step=0)
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


def test_running_minutes_leave_out_the_pause_of_a_resumed_run():
    # iterations of 60 s logged at 1, 2, 3 min; the fourth after a 30-minute pause, the end after a
    # 5-minute evaluation the pipeline measured
    stamps = [60_000, 120_000, 180_000, 180_000 + 31 * 60_000]
    minutes, total = running_minutes(0, stamps[-1] + 300_000, stamps, [60.0] * 4, 300.0)
    assert minutes == [1.0, 2.0, 3.0, 4.0] and total == 9.0
    # without a pause the gaps are kept as they are, also when shorter than the measured phases
    # (async RL overlaps them), and a run that has not ended has no total
    minutes, total = running_minutes(0, None, [90_000, 150_000], [120.0, 120.0], 0.0)
    assert minutes == [1.5, 2.5] and total != total


def test_a_resumed_runs_curve_counts_the_seconds_it_ran(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "curve")
    run = tracker.pipeline_run("r3", {"seed": 0})
    start = tracker.client.get_run(run).info.start_time
    # one stage of 3 iterations of 50 + 10 s; the third logged after a 40-minute pause (resume)
    for step, at in enumerate([60, 120, 180 + 40 * 60]):
        for key, value in {"episodes": 8.0, "turns_per_episode": 2.0, "success_rate": 0.5,
                           "rollout_seconds": 50.0, "update_seconds": 10.0}.items():
            tracker.client.log_metric(run, key, value, timestamp=start + at * 1000, step=step)
    tracker.client.log_metric(run, "heldout/stage-0/seconds", 240.0, timestamp=start, step=0)
    tracker.client.log_metric(run, "heldout/stage-0/overall/greedy_at_1", 0.5, timestamp=start, step=0)
    assert measured_seconds(tracker.client, tracker.client.get_run(run), 3, [3]) == ([60.0, 60.0, 60.0], 240.0)
    curve = from_mlflow(tracker.client, run, stage_ends=[3])
    assert curve.minutes == pytest.approx([1.0, 2.0, 3.0])
    assert [(p.label, p.minutes) for p in curve.heldout] == [("stage-0", pytest.approx(3.0))]


def test_a_step_redone_after_a_resume_counts_once_at_its_last_value(tmp_path):
    from agentgym.tracking.metric_history import metric_history

    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "curve")
    run = tracker.pipeline_run("r4", {"seed": 0})
    start = tracker.client.get_run(run).info.start_time
    # steps 0, 1 at 1 and 2 min; the run was killed in step 2 after logging it, and the resumed
    # attempt (70 min later) redid step 2 with other values, then ran step 3
    logged = [(0, 60, 2.0), (1, 120, 2.0), (2, 180, 3.0), (2, 180 + 70 * 60, 4.0), (3, 240 + 70 * 60, 5.0)]
    for step, at, turns in logged:
        for key, value in {"episodes": 8.0, "turns_per_episode": turns, "success_rate": 0.5,
                           "rollout_seconds": 50.0, "update_seconds": 10.0}.items():
            tracker.client.log_metric(run, key, value, timestamp=start + at * 1000, step=step)
    assert [(m.step, m.value) for m in metric_history(tracker.client, run, "turns_per_episode")] == [
        (0, 2.0), (1, 2.0), (2, 4.0), (3, 5.0)]
    assert tracker.metric_steps(run, "turns_per_episode") == [(0, 2.0), (1, 2.0), (2, 4.0), (3, 5.0)]
    assert measured_seconds(tracker.client, tracker.client.get_run(run), 4, [4])[0] == [60.0] * 4  # not 120 at step 2
    curve = from_mlflow(tracker.client, run, stage_ends=[4])
    assert curve.env_steps == [16.0, 32.0, 64.0, 104.0]  # the redone step's last value, once
    # step 2's gap held the pause (counted as its 60 measured s); step 3 ran a minute later
    assert curve.minutes == pytest.approx([1.0, 2.0, 3.0, 4.0])
