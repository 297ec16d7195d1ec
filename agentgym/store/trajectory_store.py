"""Trajectory store: Parquet tables over fsspec (local paths, ``s3://`` through s3fs).

Layout (Hive style, so plain pandas/pyarrow readers work with no helper)::

    {root}/{run_id}/{table}/stage={s}/iteration={i}/part-{uuid}.parquet
    {root}/{run_id}/_commits/{table}/{s}-{i}.json        # the commit manifest

    pd.read_parquet(store.path("turns"), schema=dataset_schema("turns"), filters=[("stage", "=", 2)])

Tables: ``episodes``, ``turns``, ``advantages`` and ``train_batch`` (what a resident group of
ranks trains on); their logical schemas, with a description of every column in the field
metadata, are ``agentgym.store.schema``'s ``EPISODES_SCHEMA``, ``TURNS_SCHEMA``,
``ADVANTAGES_SCHEMA``, ``TRAIN_BATCH_SCHEMA`` (docs/datasets.md is generated from them).

Partition columns (the choice)
------------------------------
``stage`` and ``iteration`` live ONLY in the directory names, never as physical columns in the
Parquet files (``physical_schema(table)`` is the logical schema minus ``PARTITION_KEYS``).
If they were stored in both places, ``pd.read_parquet(dir)`` fails with pyarrow's "Unable to
merge: Field stage has incompatible types: int32 vs dictionary<values=int32 ...>" (checked with
pyarrow 25 / pandas 3): ``pq.read_table`` (what pandas calls) discovers Hive keys with
``infer_dictionary=True``, so no content of the files can make plain ``pd.read_parquet(dir)``
give them as ints. With path-only keys:

* ``TrajectoryStore.read_table`` returns them as ``int32`` columns (filled from the manifest),
  placed where the logical schema puts them;
* ``pd.read_parquet(dir, schema=dataset_schema(table))`` returns them as int32 (the documented
  way, README and docs/datasets.md; ``partitioning=pyarrow.dataset.partitioning(flavor="hive")``
  too), and so does ``pyarrow.dataset.dataset(dir, partitioning="hive")``;
* raw ``pd.read_parquet(dir)`` returns them as pandas ``Categorical`` columns whose categories
  are int32.

``run_id`` is not a Hive key (its directory has no ``run_id=`` prefix), so it is a real column.

Writes and commits
------------------
A shard is serialised in memory, hashed (sha256), written under a hidden name
(``.tmp-{uuid}.parquet``, ignored by pyarrow/pandas, whose ``ignore_prefixes`` are ``.``/``_``)
and renamed to ``part-{uuid}.parquet``. The iteration is then committed by creating
``_commits/{table}/{s}-{i}.json`` only if it does not exist yet:

* local filesystem: the manifest is written to a hidden temp file and hard-linked into place
  (``os.link`` fails if the target exists), so create-if-absent is atomic and a reader never
  sees a half-written manifest;
* other filesystems (S3): an exists-check, then an exclusive create (``open(..., "xb")``, which
  s3fs sends as ``If-None-Match: *``; AWS S3, MinIO and SeaweedFS honour it). A server that
  ignores the header degrades to check-then-write: two writers racing on the same
  ``(table, stage, iteration)`` could then both believe they won. The pipeline never runs two
  writers for one iteration, so this is accepted and documented rather than locked.

If the commit already exists, the existing manifest is returned and the new shard deleted, so a
re-run of an iteration never duplicates rows. Once an iteration's commit is decided, ``part-*``
files in its partition directory that the manifest does not list (left by a killed writer
between rename and commit) are deleted, so raw pandas readers see only committed rows too.
``read_table`` itself reads ONLY files listed in manifests and verifies each file's sha256 and
the manifest's combined digest (``StoreError`` naming the file on mismatch).

``write_episodes`` writes the ``episodes`` and ``turns`` tables together. The ``episodes``
manifest is the single commit point for the pair: it embeds the turns manifest
(``extra["turns"]``), and the ``turns`` commit file is derived from it after the episodes commit
is decided. So the two tables always come from the same attempt, and a crash between the two
commit files is invisible: ``manifest("turns", ...)`` falls back to the embedded copy, and a
re-run writes the missing file.

``episode_writer`` streams an iteration instead (``EpisodeWriter``): every ``chunk_episodes``
episodes are staged as hidden shards as they arrive, and ``commit`` publishes them all and
creates the same single episodes manifest, so the all-or-nothing rules above hold unchanged
while the writer's memory does not grow with the iteration. Staged shards left by a killed
writer are hidden and removed by the iteration's next commit.

Schema evolution: columns are only added (``ADDED_COLUMNS``, read from older files as their
default); a file whose column type differs from the schema is cast when that is lossless and
otherwise fails with ``SchemaMismatch`` (column, file, expected and found type, the fix).
Raw readers of a folder spanning an added column pass ``schema=dataset_schema(table)``.

Precision note: ``old_logprobs``, ``advantages`` and ``returns`` are stored as float32 (the
contract); they round-trip exactly only as float32 values.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import io
import json
import logging
import os
import socket
import uuid
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Iterable

import fsspec
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from agentgym.batch import EpisodeBatch
from agentgym.infra.diskspace import disk_errors
from agentgym.store.manifest import CommitManifest, StagedShard, combined_digest, sha256_hex, utc_now
from agentgym.store.refusals import refused_writes
from agentgym.store.schema import (
    PARTITION_KEYS, SCHEMAS, TURN_TEXT, StoreError, as_list, check_table, dataset_schema,
    physical_schema, read_parquet,
)
from agentgym.types import Episode, Turn

if TYPE_CHECKING:
    from agentgym.store.episode_writer import EpisodeWriter

__all__ = ["TrajectoryStore"]

log = logging.getLogger(__name__)

# Hidden name of a shard written but not yet published (pandas/pyarrow skip "." and "_" names).
STAGED_PREFIX = ".tmp-"
NO_SPACE_FIX = "free space on that disk or set store.root to another one, then re-run"
NOT_COMMITTED = "This iteration is not committed and earlier commits are intact."
TURNS_LATER = ("The iteration's episodes are committed (their manifest holds this turns manifest); "
                "a re-run with the same run id writes it.")


def _check_token_columns(table: pa.Table, episodes: list[Episode]) -> None:
    """The per-token checks of a chunk's episodes, at once over its Arrow columns: every
    ``loss_mask`` value is 0 or 1, and every masked token has log-prob 0. (As Python loops per
    token they were most of the writer's time beyond raw pyarrow's: bench/store_throughput.py.)
    On a violation the per-episode check finds the first bad episode and names it."""
    mask = table.column("loss_mask").combine_chunks().flatten()
    logprobs = table.column("old_logprobs").combine_chunks().flatten()
    not_binary = pc.and_(pc.not_equal(mask, 0), pc.not_equal(mask, 1))
    masked_logprob = pc.and_(pc.equal(mask, 0), pc.not_equal(logprobs, 0.0))
    if not (pc.any(not_binary).as_py() or pc.any(masked_logprob).as_py()):
        return
    for ep in episodes:
        bad = [m for m in ep.loss_mask if m not in (0, 1)]
        if bad:
            raise ValueError(f"episode {ep.episode_id}: loss_mask values must be 0/1, got {bad[0]!r}")
        ep.validate()
    raise AssertionError("a token check failed on the table but on no episode")  # cannot happen


class TrajectoryStore:
    """Parquet trajectory tables for one run under ``root`` (a local path or an fsspec URL)."""

    def __init__(self, root: str, run_id: str, storage_options: dict | None = None):
        if not run_id or "/" in run_id or run_id.startswith((".", "_")):
            raise ValueError(f"bad run_id {run_id!r}: must be non-empty, no '/', no leading . or _")
        self.root = root.rstrip("/") or root
        self.run_id = run_id
        self.storage_options = dict(storage_options or {})
        self.fs, root_path = fsspec.core.url_to_fs(self.root, **self.storage_options)
        self._local = isinstance(self.fs, LocalFileSystem)
        self._base = f"{root_path.rstrip('/')}/{run_id}"  # fs path, no protocol

    def spec(self) -> dict[str, Any]:
        """Arguments that open this store from another process (a local root made absolute)."""
        root = os.path.abspath(self.root) if self._local and "://" not in self.root else self.root
        return {"root": root, "run_id": self.run_id, "storage_options": dict(self.storage_options)}

    def check_writable(self) -> None:
        """Write and delete a probe under the run's folder: an unusable ``store.root`` (no such
        bucket, no permission, a read-only path) fails here, before a rollout is spent on it."""
        probe = f"{self._base}/_commits/.probe-{uuid.uuid4().hex}"
        try:
            self._mkdirs(probe.rsplit("/", 1)[0])
            with self.fs.open(probe, "wb") as fh:
                fh.write(b"ok")
            self.fs.rm(probe)
        except Exception as e:  # noqa: BLE001 - any backend's failure, reported with the setting
            raise OSError(f"store.root {self.root!r} is not writable for run {self.run_id!r}: "
                          f"{type(e).__name__}: {e}; set store.root to a writable folder or "
                          "s3:// bucket (and store.storage_options for its credentials)") from None

    # ------------------------------------------------------------------ paths
    @staticmethod
    def location(root: str, run_id: str, table: str | None = None) -> str:
        """Where the store of ``run_id`` under ``root`` (``store.root``) lives, or one of its
        tables, as the URL or path users pass to pandas; opens nothing."""
        base = f"{root.rstrip('/')}/{run_id}"
        return base if table is None else f"{base}/{check_table(table)}"

    def path(self, table: str) -> str:
        """The table directory, usable by pandas/pyarrow (pass ``storage_options`` for s3)."""
        return self._url(f"{self._base}/{check_table(table)}")

    @staticmethod
    def dataset_schema(table: str) -> pa.Schema:
        """``agentgym.store.schema.dataset_schema``: the schema to give raw readers of a table
        folder, ``pd.read_parquet(store.path("turns"), schema=store.dataset_schema("turns"))``
        (``stage`` / ``iteration`` as int32, columns added later read as null from older files)."""
        return dataset_schema(table)

    def _url(self, fs_path: str) -> str:
        return fs_path if self._local else self.fs.unstrip_protocol(fs_path)

    def abs_path(self, rel: str) -> str:
        return f"{self._base}/{rel}"

    @staticmethod
    def _partition_rel(table: str, stage: int, iteration: int) -> str:
        return f"{table}/stage={int(stage)}/iteration={int(iteration)}"

    def _commit_path(self, table: str, stage: int, iteration: int) -> str:
        return f"{self._base}/_commits/{table}/{int(stage)}-{int(iteration)}.json"

    def _mkdirs(self, fs_dir: str) -> None:
        if self._local:
            self.fs.makedirs(fs_dir, exist_ok=True)

    def _invalidate(self, fs_path: str) -> None:
        # s3fs caches listings; other processes may have written since.
        if not self._local:
            self.fs.invalidate_cache(fs_path)

    # ------------------------------------------------------------------ writing
    def write_episodes(
        self,
        episodes: list[Episode],
        *,
        stage: int,
        iteration: int,
        global_step: int,
        policy_version: int,
    ) -> CommitManifest:
        """Write the ``episodes`` and ``turns`` tables of one iteration and commit both.

        Returns the episodes manifest (its ``extra["turns"]`` holds the turns manifest). If the
        iteration is already committed, returns the existing manifest and writes nothing. All
        episodes go into one shard per table; ``episode_writer`` streams them in chunks instead.
        """
        existing = self.manifest("episodes", stage, iteration)
        if existing is not None:
            log.info("episodes %s-%s already committed; returning it", stage, iteration)
            self._ensure_turns_commit(existing)
            return existing
        with self.episode_writer(stage=stage, iteration=iteration, global_step=global_step,
                                 policy_version=policy_version,
                                 chunk_episodes=max(1, len(episodes))) as writer:
            writer.extend(episodes)
            return writer.commit()

    def episode_writer(
        self,
        *,
        stage: int,
        iteration: int,
        global_step: int,
        policy_version: int,
        chunk_episodes: int = 64,
    ) -> EpisodeWriter:
        """A streaming writer for one iteration's episodes: ``add`` them as they finish, every
        ``chunk_episodes`` go to hidden staged shards, ``commit`` publishes all of them in one
        commit (use it as a context manager: leaving it without a commit deletes the shards)."""
        from agentgym.store.episode_writer import EpisodeWriter  # it imports this module

        return EpisodeWriter(self, int(stage), int(iteration), int(global_step),
                             int(policy_version), int(chunk_episodes))

    def write_advantages(
        self, rows: list[dict], *, stage: int, iteration: int, estimator: str
    ) -> CommitManifest:
        """Write one iteration's ``advantages`` rows ``{episode_id, advantages, returns}``."""
        stage, iteration = int(stage), int(iteration)
        table = self._advantages_table(rows, stage, iteration, str(estimator))
        return self._commit_single("advantages", stage, iteration, table, {"estimator": str(estimator)})

    def _commit_single(self, name: str, stage: int, iteration: int, table: pa.Table,
                       extra: dict[str, Any] | None = None) -> CommitManifest:
        """Write ``table`` as the one shard of ``name`` at (stage, iteration) and commit it; an
        iteration already committed returns its manifest and writes nothing."""
        existing = self.manifest(name, stage, iteration)
        if existing is not None:
            log.info("%s %s-%s already committed; returning it", name, stage, iteration)
            return existing
        rel, sha = self._write_shard(name, stage, iteration, table)
        m = self.new_manifest(name, stage, iteration, table.num_rows, [rel], [sha], self.writer_info(),
                               utc_now().isoformat())
        if extra:
            m.extra = dict(extra)
        try:
            winner = self._commit(m)
        except BaseException:  # as in EpisodeWriter.commit: no uncommitted part-* stays visible
            if self._read_manifest_file(name, stage, iteration) is None:
                self.delete_quietly([self.abs_path(rel)])
            raise
        if winner is not m:
            self.delete_quietly([self.abs_path(rel)])
        self._gc_partition(winner)
        return winner

    def write_train_batch(self, batch: EpisodeBatch, *, stage: int, iteration: int) -> CommitManifest:
        """Commit one update's batch as the train_batch table, exactly (rows in batch order, the
        episode layout; absent optional columns are stored as empty lists); idempotent like the
        others."""
        if "advantages" not in batch:
            raise ValueError("write_train_batch: the batch has no advantages column; the update trains on advantages")
        stage, iteration = int(stage), int(iteration)
        cols = {
            "run_id": [self.run_id] * len(batch),
            "episode_id": list(batch["episode_id"]),
            **{c: [as_list(v) for v in batch[c]] for c in ("input_ids", "loss_mask", "old_logprobs")},
            **{c: [as_list(v) for v in batch[c]] if c in batch else [[] for _ in range(len(batch))]
               for c in ("advantages", "returns", "old_values", "context_starts")},
            **{c: list(batch[c]) if c in batch else [None] * len(batch)
               for c in ("action_starts", "action_candidates")},
        }
        return self._commit_single("train_batch", stage, iteration, self._to_table("train_batch", cols))

    def read_train_batch(self, stage: int, iteration: int) -> EpisodeBatch:
        """``write_train_batch``'s batch back, in batch order (a column stored empty in every row
        is absent)."""
        table = self.read_arrow("train_batch", stage=stage, iteration=iteration)
        columns = {c: table.column(c).to_pylist() for c in
                   ("episode_id", "input_ids", "loss_mask", "old_logprobs", "advantages", "context_starts")}
        for c in ("returns", "old_values"):
            values = table.column(c).to_pylist()
            if any(values):
                columns[c] = values
        if table.column("action_starts").null_count < len(table):  # rollout.action_logprob=renormalised
            columns["action_starts"] = table.column("action_starts").to_pylist()
            columns["action_candidates"] = table.column("action_candidates").to_pylist()
        return EpisodeBatch(columns)

    # -- building tables (all validation happens here, before any byte is written)
    def episode_tables(
        self,
        episodes: list[Episode],
        stage: int,
        iteration: int,
        global_step: int,
        policy_version: int,
        created_at: _dt.datetime,
        seen: set[str] | None = None,
    ) -> tuple[pa.Table, pa.Table]:
        """The two tables of ``episodes``, validated; ``seen`` (episode ids of earlier chunks of
        the same write, updated here) makes a duplicate across chunks an error too."""
        seen = set() if seen is None else seen
        for ep in episodes:
            if not isinstance(ep, Episode):
                raise ValueError(f"expected Episode, got {type(ep).__name__}")
            ep.validate(tokens=False)  # the per-token checks: _check_token_columns, on the table
            if not ep.episode_id:
                raise ValueError("episode with an empty episode_id")
            if ep.episode_id in seen:
                raise ValueError(f"duplicate episode_id {ep.episode_id!r} in one write")
            seen.add(ep.episode_id)
            for t in ep.turns:
                if not isinstance(t, Turn):
                    raise ValueError(f"episode {ep.episode_id}: turn of type {type(t).__name__}")

        n = len(episodes)
        ep_cols: dict[str, list[Any]] = {
            "run_id": [self.run_id] * n,
            "global_step": [global_step] * n,
            "episode_id": [e.episode_id for e in episodes],
            "group_id": [e.group_id for e in episodes],
            "env": [e.env for e in episodes],
            "task_id": [e.task_id for e in episodes],
            "seed": [e.seed for e in episodes],
            "horizon": [e.horizon for e in episodes],
            "num_turns": [e.num_turns for e in episodes],
            "terminated": [e.terminated for e in episodes],
            "truncated": [e.truncated for e in episodes],
            "reward": [e.reward for e in episodes],
            "success": [e.success for e in episodes],
            "infra_error": [e.infra_error for e in episodes],
            "error": [e.error for e in episodes],
            "policy_version": [policy_version] * n,
            "created_at": [created_at] * n,
            "input_ids": [e.input_ids for e in episodes],
            "loss_mask": [e.loss_mask for e in episodes],
            "old_logprobs": [e.old_logprobs for e in episodes],
            "context_starts": [e.context_starts for e in episodes],
            "action_starts": [e.action_starts for e in episodes],
            "action_candidates": [e.action_candidates for e in episodes],
        }
        turn_rows = [(e, t) for e in episodes for t in e.turns]
        tu_cols: dict[str, list[Any]] = {
            "run_id": [self.run_id] * len(turn_rows),
            "episode_id": [e.episode_id for e, _ in turn_rows],
            "env": [e.env for e, _ in turn_rows],
            "task_id": [e.task_id for e, _ in turn_rows],
            "turn": [t.turn for _, t in turn_rows],
            "observation": [t.observation for _, t in turn_rows],
            "action_text": [t.action_text for _, t in turn_rows],
            "parsed_action": [t.parsed_action for _, t in turn_rows],
            "reward": [t.reward for _, t in turn_rows],
            "terminated": [t.terminated for _, t in turn_rows],
            "truncated": [t.truncated for _, t in turn_rows],
            "format_error": [t.format_error for _, t in turn_rows],
            "gen_tokens": [t.gen_tokens for _, t in turn_rows],
            "env_latency_ms": [t.env_latency_ms for _, t in turn_rows],
            "invalid_action": [t.invalid_action for _, t in turn_rows],
            "state_key": [t.state_key for _, t in turn_rows],
            "success": [e.success for e, _ in turn_rows],
            "horizon": [e.horizon for e, _ in turn_rows],
        }
        episodes_table = self._to_table("episodes", ep_cols)
        _check_token_columns(episodes_table, episodes)
        return episodes_table, self._to_table("turns", tu_cols)

    def _advantages_table(
        self, rows: list[dict], stage: int, iteration: int, estimator: str
    ) -> pa.Table:
        if not estimator:
            raise ValueError("estimator must be a non-empty string")
        seen: set[str] = set()
        for r in rows:
            missing = {"episode_id", "advantages", "returns"} - set(r)
            if missing:
                raise ValueError(f"advantages row lacks {sorted(missing)}: {sorted(r)}")
            eid = r["episode_id"]
            if not isinstance(eid, str) or not eid:
                raise ValueError(f"advantages row with bad episode_id {eid!r}")
            if eid in seen:
                raise ValueError(f"duplicate episode_id {eid!r} in advantages rows")
            seen.add(eid)
            n_adv, n_ret = len(r["advantages"]), len(r["returns"])
            if n_adv != n_ret:
                raise ValueError(f"episode {eid}: {n_adv} advantages but {n_ret} returns")
        n = len(rows)
        cols = {
            "run_id": [self.run_id] * n,
            "episode_id": [r["episode_id"] for r in rows],
            "estimator": [estimator] * n,
            "advantages": [as_list(r["advantages"]) for r in rows],
            "returns": [as_list(r["returns"]) for r in rows],
        }
        table = self._to_table("advantages", cols)
        for name in ("advantages", "returns"):
            flat = table.column(name).combine_chunks().flatten()
            if len(flat) and not pc.all(pc.is_finite(flat)).as_py():
                raise ValueError(
                    f"advantages.{name}: non-finite value (NaN/inf, or beyond float32)"
                )
        return table

    @staticmethod
    def _to_table(table: str, cols: dict[str, list]) -> pa.Table:
        schema = physical_schema(table)
        arrays = []
        for f in schema:
            try:
                arr = pa.array(cols[f.name], type=f.type)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as e:
                raise ValueError(f"{table}.{f.name}: cannot convert to {f.type}: {e}") from e
            if not f.nullable and arr.null_count:
                raise ValueError(
                    f"{table}.{f.name}: {arr.null_count} null value(s) in a non-null column"
                )
            if pa.types.is_list(f.type) and arr.null_count and not f.nullable:
                raise ValueError(f"{table}.{f.name}: null list")
            if pa.types.is_list(f.type) and arr.flatten().null_count:
                raise ValueError(f"{table}.{f.name}: null element in a list")
            arrays.append(arr)
        return pa.Table.from_arrays(arrays, schema=schema)

    # -- shards and commits
    def _write_shard(
        self, table: str, stage: int, iteration: int, data: pa.Table
    ) -> tuple[str, str]:
        """Stage ``data`` and publish it at once; returns (relative path, sha256)."""
        staged = self.stage_shard(table, stage, iteration, data)
        self._publish(staged)
        return staged.rel, staged.sha256

    def stage_shard(self, table: str, stage: int, iteration: int, data: pa.Table) -> StagedShard:
        """Serialise ``data`` and write it under a hidden name (``.tmp-{uuid}.parquet``, which
        pandas/pyarrow ignore) in its partition; ``_publish`` renames it to ``part-{uuid}``."""
        buf = io.BytesIO()
        pq.write_table(data, buf, compression="zstd")
        payload = buf.getvalue()
        part = uuid.uuid4().hex
        rel_dir = self._partition_rel(table, stage, iteration)
        fs_dir = self.abs_path(rel_dir)
        self._mkdirs(fs_dir)
        tmp = f"{fs_dir}/{STAGED_PREFIX}{part}.parquet"
        try:
            with (disk_errors(f"a {table} shard ({len(payload):,} bytes)", self._url(tmp), NO_SPACE_FIX),
                  refused_writes(f"a {table} shard ({len(payload):,} bytes)", self._url(tmp))):
                self.fs.pipe_file(tmp, payload)
        except BaseException:
            self.delete_quietly([tmp])
            raise
        return StagedShard(tmp, f"{rel_dir}/part-{part}.parquet", sha256_hex(payload),
                           data.num_rows, len(payload))

    def _publish(self, staged: StagedShard) -> None:
        """Rename a staged shard to its ``part-`` name (visible to raw readers from now on)."""
        try:
            with refused_writes("a staged shard (renamed by a copy)", self._url(self.abs_path(staged.rel))):
                self.fs.mv(staged.tmp, self.abs_path(staged.rel))
        except BaseException:
            self.delete_quietly([staged.tmp])
            raise

    def new_manifest(
        self,
        table: str,
        stage: int,
        iteration: int,
        rows: int,
        files: list[str],
        shas: list[str],
        writer: dict,
        created_at: str,
    ) -> CommitManifest:
        sha = dict(zip(files, shas))
        return CommitManifest(
            table=table,
            stage=stage,
            iteration=iteration,
            rows=int(rows),
            files=list(files),
            digest=combined_digest(sha),
            sha256=sha,
            writer=writer,
            created_at=created_at,
            run_id=self.run_id,
        )

    @staticmethod
    def writer_info() -> dict[str, Any]:
        return {"host": socket.gethostname(), "pid": os.getpid()}

    def _commit(self, m: CommitManifest) -> CommitManifest:
        """Create the commit file if absent. Returns ``m`` if it won, else the existing one."""
        path = self._commit_path(m.table, m.stage, m.iteration)
        payload = json.dumps(m.to_dict(), indent=2, sort_keys=True).encode()
        if self._create_if_absent(path, payload):
            return m
        existing = self.manifest(m.table, m.stage, m.iteration)
        if existing is None:  # pragma: no cover - only if someone deletes it in between
            raise StoreError(f"commit {path} exists but cannot be read")
        log.info(
            "%s %s-%s was committed concurrently; keeping the first",
            m.table, m.stage, m.iteration,
        )
        return existing

    def _create_if_absent(self, path: str, payload: bytes, state: str = NOT_COMMITTED) -> bool:
        parent = path.rsplit("/", 1)[0]
        self._mkdirs(parent)
        if self._local:
            tmp = f"{parent}/.tmp-{uuid.uuid4().hex}.json"
            try:  # the hidden temp file goes in every case (a full disk fails its write)
                with disk_errors("a commit manifest", path, NO_SPACE_FIX), open(tmp, "wb") as fh:
                    fh.write(payload)
                    fh.flush()
                    os.fsync(fh.fileno())
                try:
                    os.link(tmp, path)  # atomic; fails if ``path`` exists
                    return True
                except FileExistsError:
                    return False
                except OSError:  # filesystem without hard links: exclusive create instead
                    return self._create_exclusive(path, payload)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        with refused_writes("a commit manifest", self._url(path), state):
            return self._create_object_if_absent(path, payload)

    def _create_object_if_absent(self, path: str, payload: bytes) -> bool:
        # object stores: check, then exclusive create where the server supports it
        self._invalidate(path)
        if self.fs.exists(path):
            return False
        try:
            with self.fs.open(path, "xb") as fh:
                fh.write(payload)
            return True
        except (ValueError, NotImplementedError, TypeError):
            # this fsspec backend has no exclusive mode: plain check-then-write
            self._invalidate(path)
            if self.fs.exists(path):
                return False
            self.fs.pipe_file(path, payload)
            return True
        except (FileExistsError, OSError):
            self._invalidate(path)
            if self.fs.exists(path):  # precondition failed: someone else committed first
                return False
            raise

    @staticmethod
    def _create_exclusive(path: str, payload: bytes) -> bool:
        """Create ``path`` holding ``payload`` unless it exists (``O_EXCL``); a failed write
        removes it again, so no reader finds a half-written manifest."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            with disk_errors("a commit manifest", path, NO_SPACE_FIX), os.fdopen(fd, "wb") as fh:
                fh.write(payload)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        return True

    def _ensure_turns_commit(self, ep_m: CommitManifest) -> None:
        """Write the turns commit derived from an episodes commit, if it is not there yet."""
        embedded = ep_m.extra.get("turns")
        if not embedded:
            return
        turns_m = CommitManifest.from_dict(embedded)
        path = self._commit_path("turns", turns_m.stage, turns_m.iteration)
        payload = json.dumps(turns_m.to_dict(), indent=2, sort_keys=True).encode()
        if self._create_if_absent(path, payload, TURNS_LATER):
            return
        on_disk = self._read_manifest_file("turns", turns_m.stage, turns_m.iteration)
        if on_disk is None or on_disk.digest != turns_m.digest:
            # The episodes manifest is authoritative for the pair.
            log.warning("turns commit %s disagrees with its episodes commit; rewriting it", path)
            with refused_writes("a turns commit manifest", self._url(path), TURNS_LATER):
                self.fs.pipe_file(path, payload)

    def _gc_partition(self, m: CommitManifest) -> None:
        """Delete ``part-*`` shards in a decided partition that its manifest does not list."""
        fs_dir = self.abs_path(self._partition_rel(m.table, m.stage, m.iteration))
        self._invalidate(fs_dir)
        try:
            names = self.fs.ls(fs_dir, detail=False)
        except FileNotFoundError:
            return
        keep = {self.abs_path(f) for f in m.files}
        # part-* not in the manifest: a writer killed between rename and commit, or a losing
        # concurrent writer; .tmp-* (staged, hidden): a streaming writer killed mid-iteration.
        # Once the commit is decided neither can ever become part of it.
        stray = [
            p for p in names
            if p.rsplit("/", 1)[-1].startswith(("part-", STAGED_PREFIX)) and p.rstrip("/") not in keep
        ]
        if stray:
            log.warning("removing %d uncommitted shard(s) from %s", len(stray), fs_dir)
            self.delete_quietly(stray)

    def retract(self, stage: int, iteration: int, tables: Iterable[str]) -> list[str]:
        """Withdraw the commits of ``tables`` at (stage, iteration), so that the iteration can be
        written again (a resumed run redoing what a lost update produced). Nothing is deleted:
        each commit manifest, then each partition's files, move under
        ``_retracted/<time>-<id>/`` beside the tables (pandas and pyarrow skip "_" folders).

        Manifests go first, in the order given (dependents before what they derive from:
        train_batch, advantages, turns, episodes), so a process killed half-way leaves
        commits that are whole or absent; files left in a partition without its manifest are
        uncommitted ones, which the next commit there clears. Returns the tables whose commit
        was withdrawn."""
        tables = [check_table(t) for t in tables]
        dest = f"{self._base}/_retracted/{utc_now().strftime('%Y%m%dT%H%M%SZ')}-{uuid.uuid4().hex[:6]}"

        def move(path: str) -> None:  # to the same place under dest as under the run's folder
            target = dest + path[len(self._base):]
            self._mkdirs(target.rsplit("/", 1)[0])
            self.fs.mv(path, target)

        withdrawn = []
        for table in tables:
            src = self._commit_path(table, stage, iteration)
            self._invalidate(src)
            if self.fs.exists(src):
                move(src)
                withdrawn.append(table)
        for table in tables:
            part = self.abs_path(self._partition_rel(table, stage, iteration))
            self._invalidate(part)
            for path in self.fs.find(part):  # file by file: object stores have no folders to move
                move(path)
        if withdrawn:
            log.warning("retracted %s of stage %d iteration %d into %s", ", ".join(withdrawn), stage,
                        iteration, self._url(dest))
        return withdrawn

    def delete_quietly(self, paths: Iterable[str]) -> None:
        for p in paths:
            try:
                self.fs.rm_file(p)
            except FileNotFoundError:
                pass
            except OSError as e:  # pragma: no cover - best effort cleanup
                log.warning("could not delete %s: %s", p, e)

    # ------------------------------------------------------------------ commits
    def _read_manifest_file(self, table: str, stage: int, iteration: int) -> CommitManifest | None:
        path = self._commit_path(table, stage, iteration)
        self._invalidate(path)
        try:
            raw = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        try:
            d = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StoreError(f"corrupt commit manifest {self._url(path)}: {e}") from e
        if not isinstance(d, dict):
            raise StoreError(f"corrupt commit manifest {self._url(path)}: not an object")
        m = CommitManifest.from_dict(d)
        if (m.table, m.stage, m.iteration) != (table, int(stage), int(iteration)):
            raise StoreError(
                f"commit manifest {self._url(path)} describes {m.table} {m.stage}-{m.iteration}"
            )
        return m

    def manifest(self, table: str, stage: int, iteration: int) -> CommitManifest | None:
        check_table(table)
        m = self._read_manifest_file(table, stage, iteration)
        if m is None and table == "turns":
            ep = self._read_manifest_file("episodes", stage, iteration)
            if ep is not None and ep.extra.get("turns"):
                m = CommitManifest.from_dict(ep.extra["turns"])
        return m

    def is_committed(self, table: str, stage: int, iteration: int) -> bool:
        return self.manifest(table, stage, iteration) is not None

    def _committed_keys(self, table: str) -> set[tuple[int, int]]:
        d = f"{self._base}/_commits/{table}"
        self._invalidate(d)
        try:
            names = self.fs.ls(d, detail=False)
        except FileNotFoundError:
            return set()
        keys = set()
        for p in names:
            name = p.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith((".", "_")) or not name.endswith(".json"):
                continue
            s, _, i = name[: -len(".json")].partition("-")
            try:
                keys.add((int(s), int(i)))
            except ValueError:
                log.warning("ignoring unexpected file %s in %s", name, d)
        return keys

    def commits(self, table: str) -> list[CommitManifest]:
        """All committed iterations of ``table``, sorted by (stage, iteration)."""
        return self._manifests(table)

    def _manifests(
        self, table: str, stage: int | None = None, iteration: int | None = None
    ) -> list[CommitManifest]:
        check_table(table)
        if stage is not None and iteration is not None:
            m = self.manifest(table, stage, iteration)
            return [m] if m is not None else []
        keys = self._committed_keys(table)
        if table == "turns":
            keys |= self._committed_keys("episodes")
        keys = {
            (s, i) for s, i in keys
            if (stage is None or s == int(stage)) and (iteration is None or i == int(iteration))
        }
        out = [self.manifest(table, s, i) for s, i in sorted(keys)]
        return [m for m in out if m is not None]

    # ------------------------------------------------------------------ reading
    def read_arrow(
        self,
        table: str,
        *,
        stage: int | None = None,
        iteration: int | None = None,
        columns: list[str] | None = None,
        verify: bool = True,
    ) -> pa.Table:
        """Committed rows as an Arrow table with the logical schema (or ``columns`` of it)."""
        schema = SCHEMAS[check_table(table)]
        wanted = list(columns) if columns is not None else schema.names
        unknown = [c for c in wanted if c not in schema.names]
        if unknown:
            raise ValueError(f"{table} has no column(s) {unknown}")
        manifests = self._manifests(table, stage, iteration)
        file_cols = [c for c in wanted if c not in PARTITION_KEYS]
        out_schema = pa.schema([schema.field(c) for c in wanted])
        parts: list[pa.Table] = []
        for m in manifests:
            m.check()
            if not m.files:
                continue
            paths = [self.abs_path(f) for f in m.files]
            blobs = self._fetch(paths)
            got: list[pa.Table] = []
            for rel, path in zip(m.files, paths):
                data = blobs.get(path)
                if not isinstance(data, bytes):
                    raise StoreError(
                        f"committed file missing or unreadable: {self._url(path)}: {data!r}"
                    )
                if verify and sha256_hex(data) != m.sha256[rel]:
                    raise StoreError(
                        f"sha256 mismatch for {self._url(path)} (commit {table} "
                        f"{m.stage}-{m.iteration}): the file changed after it was committed"
                    )
                try:
                    t = read_parquet(data, file_cols, table, self._url(path))
                except (pa.ArrowException, OSError) as e:
                    raise StoreError(f"unreadable Parquet file {self._url(path)}: {e}") from e
                got.append(t)
            n = sum(t.num_rows for t in got)
            if n != m.rows:
                raise StoreError(
                    f"commit {table} {m.stage}-{m.iteration} promises {m.rows} rows, files hold {n}"
                )
            for t in got:
                cols = []
                for c in wanted:
                    # the partition keys: one value repeated, built in Arrow (a Python list of
                    # n ints cost a quarter of a 100k-turn read)
                    if c == "stage":
                        cols.append(pa.repeat(pa.scalar(m.stage, pa.int32()), t.num_rows))
                    elif c == "iteration":
                        cols.append(pa.repeat(pa.scalar(m.iteration, pa.int32()), t.num_rows))
                    else:
                        cols.append(t.column(c))
                parts.append(pa.Table.from_arrays(cols, schema=out_schema))
        if not parts:
            return out_schema.empty_table()
        return pa.concat_tables(parts)

    def _fetch(self, paths: list[str]) -> dict[str, Any]:
        """Bytes of each path (concurrently on object stores); an exception where it failed."""
        if not self._local and len(paths) > 1:
            try:
                got = self.fs.cat(paths, on_error="return")
                if isinstance(got, dict) and set(got) == set(paths):
                    return got
            except OSError:
                pass
        out: dict[str, Any] = {}
        for p in paths:
            try:
                out[p] = self.fs.cat_file(p)
            except OSError as e:
                out[p] = e
        return out

    def read_table(
        self,
        table: str,
        *,
        stage: int | None = None,
        iteration: int | None = None,
        columns: list[str] | None = None,
        verify: bool = True,
    ) -> pd.DataFrame:
        """Committed rows as a DataFrame (only files listed in commit manifests are read)."""
        t = self.read_arrow(table, stage=stage, iteration=iteration, columns=columns, verify=verify)
        return t.to_pandas()

    def read_episodes(self, stage: int, iteration: int, *, turn_text: bool = True) -> list[Episode]:
        """The episodes of one committed iteration, with their turns, in written order.

        ``turn_text=False`` does not read the turns' text columns (observation, action text,
        parsed action: most of the turns table's bytes); those fields come back empty. The
        numeric steps (metrics, advantages, the update) need only the tokens and turn flags.
        """
        t = self.read_arrow("episodes", stage=stage, iteration=iteration)
        turns: dict[str, list[Turn]] = {}
        if len(t):
            turn_fields = [f.name for f in fields(Turn)]
            read = turn_fields if turn_text else [c for c in turn_fields if c not in TURN_TEXT]
            tt = self.read_arrow("turns", stage=stage, iteration=iteration,
                                 columns=["episode_id", *read])
            blank: dict[str, Any] = {} if turn_text else {"observation": "", "action_text": "", "parsed_action": None}
            for r in tt.to_pylist():
                eid = r.pop("episode_id")
                turns.setdefault(eid, []).append(Turn(**r, **blank))
            for lst in turns.values():
                lst.sort(key=lambda x: x.turn)
        ep_fields = [f.name for f in fields(Episode) if f.name != "turns"]
        out = []
        for r in t.select(ep_fields).to_pylist():
            out.append(Episode(**r, turns=turns.get(r["episode_id"], [])))
        return out


