"""Ended episodes of ``agentgym gateway serve`` written to a run's trajectory store.

The gateway's ``on_end`` hands each finished episode to :class:`StoreSink`, which adds it to an
``EpisodeWriter`` of stage 0 and commits every ``commit_every`` episodes as one iteration (the
next free one: a restarted server appends to the run), and what is left at :meth:`close`. The
episodes are the rollout's records (env ``agent``), read back by ``read_episodes``,
``agentgym inspect`` and the viewer like any other.
"""

from __future__ import annotations

import threading

from agentgym.store.episode_writer import EpisodeWriter
from agentgym.store.trajectory_store import TrajectoryStore
from agentgym.types import Episode


class StoreSink:
    def __init__(self, store: TrajectoryStore, commit_every: int = 16, chunk_episodes: int = 64,
                 policy_version: int = 0):
        if commit_every < 1:
            raise ValueError(f"commit_every must be >= 1, got {commit_every}")
        self.store = store
        self.commit_every, self.chunk_episodes, self.policy_version = commit_every, chunk_episodes, policy_version
        self.committed: list[tuple[int, int]] = []  # (iteration, episodes) of each commit
        self._writer: EpisodeWriter | None = None
        self._lock = threading.Lock()

    def _next_iteration(self) -> int:
        return max((m.iteration for m in self.store.commits("episodes") if m.stage == 0), default=-1) + 1

    def add(self, episode: Episode) -> None:
        with self._lock:
            if self._writer is None:
                it = self._next_iteration()
                self._writer = self.store.episode_writer(stage=0, iteration=it, global_step=it,
                                                         policy_version=self.policy_version,
                                                         chunk_episodes=self.chunk_episodes)
            self._writer.add(episode)
            if self._writer.rows >= self.commit_every:
                self._commit()

    def _commit(self) -> None:
        writer, self._writer = self._writer, None
        if writer is None:
            return
        try:
            manifest = writer.commit()
        except BaseException:
            writer.abort()
            raise
        self.committed.append((writer.iteration, manifest.rows))

    def close(self) -> None:
        """Commit the episodes added since the last commit."""
        with self._lock:
            self._commit()
