"""Bootstrap intervals for held-out success, paired on tasks.

Every arm of the ablation (a horizon schedule) is evaluated on the *same* held-out tasks, so arms
are compared task by task: a task both arms solve or both fail says nothing about the schedules,
and pairing removes the task-difficulty variance from the difference. Seeds are not paired (seed
``s`` of one schedule shares nothing with seed ``s`` of another after the first update), so they
are resampled independently per arm.

Arrays are ``successes[seed, task]`` in {0, 1} (or any score), with the columns in the same task
order in every arm.
"""

from __future__ import annotations

import numpy as np


def _resampled_means(x: np.ndarray, task_idx: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Per draw, the mean of ``x`` over resampled seeds (own draw) and the given task indices.

    x: (seeds, tasks); task_idx: (draws, tasks) -> (draws,)
    """
    draws = task_idx.shape[0]
    seed_idx = rng.integers(0, x.shape[0], size=(draws, x.shape[0]))
    # rows: the resampled seeds of each draw; columns: the resampled tasks of that draw
    picked = x[seed_idx[:, :, None], task_idx[:, None, :]]  # (draws, seeds, tasks)
    return picked.mean(axis=(1, 2))


def _interval(values: np.ndarray, level: float) -> tuple[float, float]:
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(values, [tail, 1.0 - tail])
    return float(lo), float(hi)


def mean_interval(x: np.ndarray, *, draws: int = 10_000, level: float = 0.95,
                  seed: int = 0) -> tuple[float, float, float]:
    """The mean success of one arm and its percentile bootstrap interval over tasks and seeds.

    x: (seeds, tasks). Returns ``(mean, low, high)``.
    """
    x = np.asarray(x, dtype=float)
    rng = np.random.default_rng(seed)
    task_idx = rng.integers(0, x.shape[1], size=(draws, x.shape[1]))
    return (float(x.mean()), *_interval(_resampled_means(x, task_idx, rng), level))


def paired_difference(a: np.ndarray, b: np.ndarray, *, draws: int = 10_000, level: float = 0.95,
                      seed: int = 0) -> tuple[float, float, float]:
    """Mean success of arm ``a`` minus arm ``b`` and its percentile bootstrap interval.

    a: (seeds_a, tasks), b: (seeds_b, tasks), the same tasks in the same column order. Each draw
    resamples the tasks once for both arms (paired) and the seeds of each arm on their own.
    Returns ``(difference, low, high)``; an interval that excludes 0 separates the arms at
    ``level``.
    """
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"paired arms need the same tasks: {a.shape[1]} vs {b.shape[1]} columns")
    rng = np.random.default_rng(seed)
    task_idx = rng.integers(0, a.shape[1], size=(draws, a.shape[1]))
    diffs = _resampled_means(a, task_idx, rng) - _resampled_means(b, task_idx, rng)
    return (float(a.mean() - b.mean()), *_interval(diffs, level))
