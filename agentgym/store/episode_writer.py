"""Writing one iteration's episodes as they finish: shards staged in batches while the rollout
runs, one commit at the end (or nothing, on abort)."""

from __future__ import annotations

import logging
from typing import Iterable


from agentgym.types import Episode

from agentgym.store.manifest import CommitManifest, StagedShard, utc_now
from agentgym.store.trajectory_store import TrajectoryStore

log = logging.getLogger(__name__)


class EpisodeWriter:
    """Streams one iteration's episodes to the store in chunks, committed all-or-nothing.

    Why: a rollout used to hold every episode of an iteration until one ``write_episodes`` at
    the end, so its memory grew with the number of episodes. Here each ``chunk_episodes``
    episodes become one staged (hidden) shard per table as soon as they are added, and only
    small bookkeeping (the staged shards' names and hashes, the episode ids for the duplicate
    check) stays in memory.

    All-or-nothing: nothing is visible before ``commit``. Staged shards have hidden names
    (``.tmp-*``), which pandas/pyarrow skip and no manifest lists; ``commit`` renames them to
    ``part-*`` and creates the one episodes manifest (with the turns manifest embedded), exactly
    as ``write_episodes`` does for a single shard. An exception before the commit (leaving the
    ``with`` block, or ``abort``) deletes the staged shards; a process killed mid-iteration
    leaves hidden files only, which the next commit of that iteration deletes
    (``_gc_partition``). If the iteration was committed meanwhile, ``commit`` returns that
    manifest and deletes its own shards, like ``write_episodes``.
    """

    def __init__(self, store: TrajectoryStore, stage: int, iteration: int, global_step: int,
                 policy_version: int, chunk_episodes: int):
        if chunk_episodes < 1:
            raise ValueError(f"chunk_episodes must be >= 1, got {chunk_episodes}")
        self.store = store
        self.stage, self.iteration = stage, iteration
        self.global_step, self.policy_version = global_step, policy_version
        self.chunk_episodes = chunk_episodes
        self.created_at = utc_now()  # one timestamp for the whole iteration, as one write had
        self._buffer: list[Episode] = []
        self._seen: set[str] = set()
        self._staged: dict[str, list[StagedShard]] = {"episodes": [], "turns": []}
        self._state = "open"  # open -> committed | aborted

    # -- adding
    def add(self, episode: Episode) -> None:
        """Buffer one finished episode; a full chunk is written out (staged) at once."""
        self._check_open()
        self._buffer.append(episode)
        if len(self._buffer) >= self.chunk_episodes:
            self.flush()

    def extend(self, episodes: Iterable[Episode]) -> None:
        for ep in episodes:
            self.add(ep)

    def flush(self) -> None:
        """Stage the buffered episodes (one shard per table), validated first."""
        self._check_open()
        if self._buffer:
            self._stage(self._buffer)
            self._buffer = []

    def _stage(self, episodes: list[Episode]) -> None:
        ep_table, turn_table = self.store.episode_tables(
            episodes, self.stage, self.iteration, self.global_step, self.policy_version,
            self.created_at, seen=self._seen,
        )
        for name, data in (("episodes", ep_table), ("turns", turn_table)):
            self._staged[name].append(self.store.stage_shard(name, self.stage, self.iteration, data))

    @property
    def rows(self) -> int:
        """Episodes added so far (staged or buffered)."""
        return sum(s.rows for s in self._staged["episodes"]) + len(self._buffer)

    @property
    def staged_bytes(self) -> int:
        """Bytes written to staged shards so far (both tables)."""
        return sum(s.nbytes for shards in self._staged.values() for s in shards)

    # -- writers in other processes (rollout workers)
    def hand_off(self) -> dict[str, list[StagedShard]]:
        """Stage what is buffered and give the staged shards to the writer that commits them
        (``adopt``, in the flow's process); this writer is then done and deletes nothing. A
        rollout worker ends its share of an iteration with this: the driver commits once."""
        self.flush()
        staged, self._staged = self._staged, {"episodes": [], "turns": []}
        self._state = "handed_off"
        return staged

    def adopt(self, staged: dict[str, list[StagedShard]], episode_ids: Iterable[str]) -> None:
        """Take over shards another writer of the same iteration staged (``hand_off``), so that
        ``commit`` publishes them with this writer's own, and ``abort`` deletes them too.
        ``episode_ids``: the episodes they hold; an id already added or adopted is refused (a
        re-played share must not be committed twice)."""
        self._check_open()
        ids = list(episode_ids)
        dup = self._seen.intersection(ids)
        if dup or len(set(ids)) != len(ids):
            raise ValueError(f"episodes {sorted(dup)[:3] or ids[:3]} were staged twice for "
                             f"{self.stage}-{self.iteration}; adopt each worker's shards once")
        self._seen.update(ids)
        for name in self._staged:
            self._staged[name].extend(staged.get(name, []))

    # -- ending
    def commit(self) -> CommitManifest:
        """Publish every staged shard and commit the iteration once; returns the episodes
        manifest that won (another writer's, if the iteration was committed first)."""
        self._check_open()
        self.flush()
        if not self._staged["episodes"]:
            self._stage([])  # an empty iteration still gets its (empty) shards and commit
        st = self.store
        existing = st.manifest("episodes", self.stage, self.iteration)
        if existing is not None:
            log.info("episodes %s-%s already committed; keeping it", self.stage, self.iteration)
            self.abort()
            st._ensure_turns_commit(existing)
            return existing
        published: list[StagedShard] = []
        try:
            for shards in self._staged.values():
                for s in shards:
                    st._publish(s)
                    published.append(s)
        except Exception:
            self.abort(published)
            # a concurrent writer that committed first also removes staged shards it does not
            # list (ours among them): then its commit is the answer, not an error
            winner = st.manifest("episodes", self.stage, self.iteration)
            if winner is None:
                raise
            return winner
        except BaseException:
            self.abort(published)
            raise
        mine = self._manifest()
        try:
            winner = st._commit(mine)
        except BaseException:
            # e.g. a full disk while writing the manifest: the renamed shards are visible to raw
            # readers but belong to no commit; remove them unless the commit landed after all
            if st._read_manifest_file("episodes", self.stage, self.iteration) is None:
                self.abort(published)
            raise
        self._state = "committed"
        st._ensure_turns_commit(winner)
        if winner is not mine:  # committed concurrently: ours is not listed anywhere
            st.delete_quietly([st.abs_path(s.rel) for s in published])
        st._gc_partition(winner)
        st._gc_partition(CommitManifest.from_dict(winner.extra["turns"]))
        return winner

    def _manifest(self) -> CommitManifest:
        """The episodes manifest over the staged shards, the turns manifest embedded."""
        writer, stamp = self.store.writer_info(), self.created_at.isoformat()

        def manifest(name: str) -> CommitManifest:
            shards = self._staged[name]
            return self.store.new_manifest(
                name, self.stage, self.iteration, sum(s.rows for s in shards),
                [s.rel for s in shards], [s.sha256 for s in shards], writer, stamp,
            )

        turns_m = manifest("turns")
        turns_m.extra = {"committed_with": "episodes"}
        ep_m = manifest("episodes")
        ep_m.extra = {"global_step": self.global_step, "policy_version": self.policy_version,
                      "chunks": len(self._staged["episodes"]), "turns": turns_m.to_dict()}
        return ep_m

    def abort(self, published: list[StagedShard] | None = None) -> None:
        """Delete every shard this writer wrote (staged, or already renamed: ``published``);
        nothing of it was committed. Safe to call twice."""
        if self._state in ("committed", "handed_off"):
            return
        renamed = {id(s) for s in published or []}
        paths = [self.store.abs_path(s.rel) if id(s) in renamed else s.tmp
                 for shards in self._staged.values() for s in shards]
        self.store.delete_quietly(paths)
        self._staged = {"episodes": [], "turns": []}
        self._buffer = []
        self._state = "aborted"

    def _check_open(self) -> None:
        if self._state != "open":
            raise RuntimeError(f"episode writer for {self.stage}-{self.iteration} is {self._state}")

    def __enter__(self) -> EpisodeWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # An exception, or leaving without commit(): nothing may stay behind.
        if self._state == "open":
            self.abort()
