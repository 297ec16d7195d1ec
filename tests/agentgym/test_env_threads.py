"""The env thread pools the rollout borrows (agentgym.rollout.env_threads): kept between rollouts, never
shared by two at once, dropped after a failure."""

import threading

import pytest

from agentgym.rollout.env_threads import env_pool


def _threads_used(pool, n: int) -> set[int]:
    """The threads that run ``n`` calls that all wait for each other (so ``n`` distinct ones)."""
    barrier = threading.Barrier(n)

    def call(_):
        barrier.wait(timeout=30)
        return threading.get_ident()

    return set(pool.map(call, range(n)))


def test_a_later_rollout_gets_the_same_pool_and_its_threads():
    with env_pool(3) as first:
        threads = _threads_used(first, 3)
    with env_pool(3) as again:
        assert again is first
        assert _threads_used(again, 3) == threads  # no thread started anew


def test_concurrent_rollouts_never_share_a_pool_and_each_keeps_its_bound():
    with env_pool(2) as a, env_pool(2) as b:
        assert a is not b
        assert a._max_workers == b._max_workers == 2  # env_workers bounds each rollout


def test_a_pool_whose_rollout_failed_is_shut_down_and_not_lent_again():
    with pytest.raises(RuntimeError):
        with env_pool(5) as failed:
            _threads_used(failed, 2)
            raise RuntimeError("rollout failed")
    with pytest.raises(RuntimeError, match="shutdown"):
        failed.submit(print)
    with env_pool(5) as fresh:
        assert fresh is not failed
