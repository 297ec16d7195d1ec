"""The thread pools that step environments, kept from one rollout to the next.

Why: ``Thread.start`` waits until the new thread has run, so a rollout that starts its 64 env
threads afresh waits for 64 scheduler round trips before its episodes have all reset, and
rollouts run once per iteration (and per evaluation). The cost on a loaded CPU is in
bench/README.md (env concurrency).

How: :func:`env_pool` lends a pool of ``workers`` threads for one rollout and takes it back
after; a rollout holds its pool alone (a second, concurrent rollout gets another), so
``rollout.env_workers`` still bounds each rollout's concurrent environment calls. Idle pools
wait on an empty queue (no CPU) and their threads end at interpreter exit, as any
``ThreadPoolExecutor``'s do. A pool whose rollout failed may still run a step; it is shut down,
never lent again. Pools are per process: threads do not survive a fork.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

_lock = threading.Lock()
_idle: dict[tuple[int, int], list[ThreadPoolExecutor]] = {}  # (pid, workers) -> idle pools


@contextmanager
def env_pool(workers: int) -> Iterator[ThreadPoolExecutor]:
    """A pool of at most ``workers`` threads, this caller's alone until the block ends."""
    key = (os.getpid(), workers)
    with _lock:
        idle = _idle.get(key)
        pool = idle.pop() if idle else None
    if pool is None:
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="env")
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=True)  # as the `with ThreadPoolExecutor` it replaces: no step left running
        raise
    with _lock:
        if os.getpid() == key[0]:
            _idle.setdefault(key, []).append(pool)


__all__ = ["env_pool"]
