"""bench/learning/quickstart_seeds.py, its pure parts: per-task rows from the held-out artifacts,
and the table over seeds with its bootstrap interval."""

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "learning"))
import quickstart_seeds as qs  # noqa: E402
from bootstrap import mean_interval  # noqa: E402


def _report(successes: list[int], n: int = 1) -> dict:
    # EvalReport.to_dict()'s task rows, deliberately out of task order
    ids = list(range(len(successes)))[::-1]
    return {"tasks": [{"env": "babyai", "task_id": str(4000 + i), "successes": successes[i], "n": n} for i in ids]}


def test_policy_rows_take_greedy_for_policies_sampled_for_random_and_order_the_stages():
    arts = {"stage-1": {"greedy": _report([1, 1, 0, 1])}, "base": {"greedy": _report([0, 0, 0, 1])},
            "random-valid": {"sampled": _report([3, 0, 10, 5], n=10), "greedy": None},
            "stage-0": {"greedy": _report([1, 0, 0, 1])}}
    rows = qs.policy_rows(arts)
    assert list(rows) == ["random-valid", "base", "stage-0", "stage-1"]
    assert rows["random-valid"] == {"tasks": [4000, 4001, 4002, 4003], "success": [0.3, 0.0, 1.0, 0.5]}
    assert rows["stage-1"]["success"] == [1.0, 1.0, 0.0, 1.0]


def _record(seed: int, stage: list[float]) -> dict:
    tasks = list(range(len(stage)))
    return {"seed": seed, "wall_min": 7.0 + seed, "policies": {
        "base": {"tasks": tasks, "success": [0.0] * len(stage)}, "stage-0": {"tasks": tasks, "success": stage}}}


def test_report_gives_each_seed_and_the_mean_with_its_interval_over_tasks_and_seeds():
    a, b = [1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]
    text = qs.report_markdown([_record(1, b), _record(0, a)])
    row = next(ln for ln in text.splitlines() if ln.startswith("| stage-0 |"))
    m, lo, hi = mean_interval(np.array([a, b]))
    assert row == f"| stage-0 | 0.750 | 0.500 | {m:.3f} [{lo:.3f}, {hi:.3f}] |" and m == pytest.approx(0.625)
    assert "| seed 0 | seed 1 |" in text.splitlines()[0] and "| 7.0 | 8.0 |" in text


def test_report_refuses_seeds_scored_on_different_tasks():
    other = _record(1, [1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="different held-out tasks"):
        qs.report_markdown([_record(0, [1.0, 0.0, 1.0, 1.0]), other])
