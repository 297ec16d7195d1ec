"""The ablation's bootstrap intervals: closed form, a second implementation (SciPy), pairing."""

import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "learning"))
from bootstrap import mean_interval, paired_difference  # noqa: E402


def _arms(tasks=64, seed=3):
    rng = np.random.default_rng(seed)
    difficulty = rng.uniform(0, 1, tasks)
    a = (rng.uniform(0, 1, (1, tasks)) < difficulty).astype(float)
    b = (rng.uniform(0, 1, (1, tasks)) < difficulty * 0.7).astype(float)
    return a, b


def test_identical_or_shifted_arms_have_a_degenerate_interval():
    a, _ = _arms()
    assert paired_difference(a, a) == (0.0, 0.0, 0.0)
    diff, lo, hi = paired_difference(a + 0.25, a)
    assert diff == pytest.approx(0.25) and lo == pytest.approx(0.25) and hi == pytest.approx(0.25)


def test_the_spread_of_one_seed_is_the_closed_form_standard_error():
    a, b = _arms(tasks=1000)  # fine enough that the quantiles are not steps of 1/n
    d = (a - b)[0]
    # the bootstrap distribution of a mean over n resampled tasks has variance var_pop(d) / n
    expected_se = d.std() / np.sqrt(d.size)
    _, lo, hi = paired_difference(a, b, draws=20_000, level=0.6827)
    assert (hi - lo) / 2 == pytest.approx(expected_se, rel=0.05)
    m, lo, hi = mean_interval(a, draws=20_000, level=0.6827)
    assert m == pytest.approx(a.mean()) and (hi - lo) / 2 == pytest.approx(a[0].std() / np.sqrt(a.size), rel=0.05)


def test_one_seed_agrees_with_scipys_paired_percentile_bootstrap():
    a, b = _arms()
    ours = paired_difference(a, b, draws=20_000)
    theirs = stats.bootstrap((a[0], b[0]), lambda x, y: x.mean() - y.mean(), paired=True, vectorized=False,
                             n_resamples=20_000, method="percentile", random_state=1).confidence_interval
    assert ours[1] == pytest.approx(theirs.low, abs=0.015) and ours[2] == pytest.approx(theirs.high, abs=0.015)


def test_pairing_removes_the_task_variance():
    rng = np.random.default_rng(0)
    easy = (rng.uniform(0, 1, 64) < 0.5).astype(float)  # half the tasks solved by both arms
    a = easy.copy()
    a[np.flatnonzero(easy == 0)[:6]] = 1.0  # arm a also solves 6 of the others
    diff, lo, hi = paired_difference(a[None], easy[None])
    assert diff == pytest.approx(6 / 64) and lo > 0  # the pairs separate the arms...
    unpaired_lo = mean_interval(a[None])[1] - mean_interval(easy[None])[2]
    assert unpaired_lo < 0  # ...where the two arms' own intervals overlap


def test_seeds_widen_the_interval():
    a, b = _arms()
    noisy = np.vstack([a[0], 1 - a[0]])  # two seeds that disagree on every task
    one = paired_difference(a, b)
    two = paired_difference(noisy, b)
    assert two[2] - two[1] > one[2] - one[1]


def test_arms_on_different_tasks_are_refused():
    with pytest.raises(ValueError, match="same tasks"):
        paired_difference(np.ones((1, 3)), np.ones((1, 4)))
