"""Tests for agentgym.store.trajectory_store: local filesystem, plus a real S3-compatible server (SeaweedFS)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from agentgym.store.manifest import CommitManifest
from agentgym.store.schema import ADVANTAGES_SCHEMA, EPISODES_SCHEMA, TURNS_SCHEMA, StoreError, physical_schema
from agentgym.store.trajectory_store import TrajectoryStore
from agentgym.types import Episode, Turn
from agentgym.batch import EpisodeBatch

RUN = "run-1"


def make_episode(i: int, n_turns: int = 2, *, stage: int = 1, seed: int = 0) -> Episode:
    rng = np.random.default_rng(1000 * stage + i + seed)
    ep = Episode(
        episode_id=f"s{stage}-e{i}",
        group_id=f"g{i // 2}",
        env="babyai" if i % 2 else "textcraft",
        task_id=10_000_000_000 + i,  # needs int64
        seed=2**40 + i,
        horizon=5 + stage,
    )
    ep.append(rng.integers(0, 50_000, size=7).tolist(), sampled=False)  # prompt
    turns = []
    for t in range(n_turns):
        ids = rng.integers(0, 50_000, size=3 + t).tolist()
        ep.append(ids, sampled=True, logprobs=(-rng.random(len(ids)) * 3).tolist())
        ep.append(rng.integers(0, 50_000, size=4).tolist(), sampled=False)  # observation
        turns.append(
            Turn(
                turn=t,
                observation=f"obs {t} of {i} — ünïcode",
                action_text=f"Action: go {t}",
                parsed_action=None if t == 0 and i == 0 else f"go {t}",
                reward=0.25 * t,
                terminated=t == n_turns - 1,
                truncated=False,
                format_error=t == 0 and i == 0,
                gen_tokens=len(ids),
                env_latency_ms=1.5 * t,
            )
        )
    ep.turns = turns
    ep.reward = float("nan") if i == 2 else (1.0 if i % 2 else 0.0)  # an infra error is unscored
    ep.success = bool(i % 2)
    ep.terminated = True
    ep.error = "boom" if i == 2 else None
    ep.infra_error = i == 2
    return ep


def f32(xs):
    return np.asarray(xs, dtype=np.float32).tolist()


def shards(root: Path, table: str | None = None) -> list[Path]:
    base = root / RUN / table if table else root / RUN
    return sorted(p for p in base.rglob("*.parquet"))


@pytest.fixture
def store(tmp_path) -> TrajectoryStore:
    return TrajectoryStore(str(tmp_path / "store"), RUN)


# ---------------------------------------------------------------------------- round trips
def test_episode_roundtrip_exact_tokens_and_schema(store, tmp_path):
    eps = [make_episode(i) for i in range(4)]
    m = store.write_episodes(eps, stage=1, iteration=0, global_step=7, policy_version=3)
    assert isinstance(m, CommitManifest)
    assert (m.table, m.stage, m.iteration, m.rows) == ("episodes", 1, 0, 4)
    assert len(m.files) == 1 and m.files[0].startswith("episodes/stage=1/iteration=0/part-")
    assert set(m.sha256) == set(m.files)
    assert m.writer["pid"] == os.getpid()

    back = store.read_episodes(1, 0)
    assert [e.episode_id for e in back] == [e.episode_id for e in eps]
    for a, b in zip(eps, back):
        assert b.input_ids == a.input_ids
        assert b.loss_mask == a.loss_mask
        assert b.old_logprobs == f32(a.old_logprobs)  # stored as float32
        for name in ("group_id", "env", "task_id", "seed", "horizon", "success",
                     "terminated", "truncated", "infra_error", "error"):
            assert getattr(b, name) == getattr(a, name), name
        assert b.reward == a.reward or (math.isnan(a.reward) and math.isnan(b.reward))
        assert b.turns == a.turns  # every Turn field is exact
        b.validate()

    # the Parquet file holds the physical schema; the reader gives the logical one
    (f,) = shards(tmp_path / "store", "episodes")
    assert pq.read_schema(f).equals(physical_schema("episodes"), check_metadata=False)
    assert "stage" not in pq.read_schema(f).names
    t = store.read_arrow("episodes")
    assert t.schema.equals(EPISODES_SCHEMA)

    df = store.read_table("episodes")
    assert df["stage"].dtype == np.int32 and df["iteration"].dtype == np.int32
    assert (df["stage"] == 1).all() and (df["global_step"] == 7).all()
    assert df["global_step"].dtype == np.int32 and df["policy_version"].dtype == np.int64
    assert df["task_id"].tolist() == [e.task_id for e in eps]
    assert str(df["created_at"].dtype) == "datetime64[us, UTC]"
    assert df["num_turns"].tolist() == [2, 2, 2, 2]
    assert df["error"].isna().tolist() == [True, True, False, True]
    assert list(df["input_ids"].iloc[1]) == eps[1].input_ids
    assert df["input_ids"].iloc[1].dtype == np.int32
    assert df["loss_mask"].iloc[1].dtype == np.int8
    assert df["old_logprobs"].iloc[1].dtype == np.float32


def test_turns_table_one_row_per_turn(store):
    eps = [make_episode(i, n_turns=i + 1) for i in range(3)]
    store.write_episodes(eps, stage=2, iteration=5, global_step=0, policy_version=0)
    assert store.manifest("turns", 2, 5).rows == 1 + 2 + 3
    df = store.read_table("turns", stage=2, iteration=5)
    assert store.read_arrow("turns").schema.equals(TURNS_SCHEMA)
    assert len(df) == 6
    assert df.groupby("episode_id")["turn"].apply(list).to_dict() == {
        "s1-e0": [0], "s1-e1": [0, 1], "s1-e2": [0, 1, 2]
    }
    assert df["turn"].dtype == np.int32 and df["gen_tokens"].dtype == np.int32
    assert df["parsed_action"].isna().sum() == 1
    assert df["observation"].iloc[0] == "obs 0 of 0 — ünïcode"
    assert set(df["stage"]) == {2} and set(df["iteration"]) == {5}


def test_pandas_reads_hive_layout_with_filters(store):
    for s in (1, 2):
        for it in (0, 1):
            store.write_episodes(
                [make_episode(i, stage=s, seed=it) for i in range(2 + s)],
                stage=s, iteration=it, global_step=10 * s + it, policy_version=it,
            )
    ep_dir = store.path("episodes")
    assert ep_dir.endswith(f"/{RUN}/episodes")
    df = pd.read_parquet(ep_dir)
    assert len(df) == 2 * 3 + 2 * 4
    assert sorted(df["stage"].astype(int).unique()) == [1, 2]  # int-like (categorical of int32)
    assert np.issubdtype(np.asarray(df["stage"].cat.categories).dtype, np.integer)

    d1 = pd.read_parquet(ep_dir, filters=[("stage", "=", 1)])
    assert len(d1) == 6 and set(d1["stage"].astype(int)) == {1}
    d2 = pd.read_parquet(store.path("turns"), filters=[("stage", "=", 2), ("iteration", "=", 1)])
    assert len(d2) == 4 * 2 and set(d2["iteration"].astype(int)) == {1}
    # pyarrow datasets infer plain int32 for the keys
    t = ds.dataset(ep_dir, partitioning="hive").to_table(filter=ds.field("stage") == 2)
    assert t.schema.field("stage").type == pa.int32() and t.num_rows == 8
    # the store's own reader agrees
    assert len(store.read_table("episodes", stage=1)) == 6
    assert len(store.read_table("episodes", iteration=1)) == 3 + 4
    assert len(store.read_table("turns", stage=2, iteration=1)) == 8


def test_multiple_stages_commits_sorted(store):
    order = [(2, 0), (1, 1), (1, 0), (3, 2), (1, 10)]
    for s, it in order:
        store.write_episodes([make_episode(0, stage=s)], stage=s, iteration=it,
                             global_step=0, policy_version=0)
    expect = sorted(order)
    for table in ("episodes", "turns"):
        got = [(m.stage, m.iteration) for m in store.commits(table)]
        assert got == expect, table
    assert store.commits("advantages") == []
    assert store.is_committed("episodes", 1, 10) and store.is_committed("turns", 1, 10)
    assert not store.is_committed("episodes", 1, 2)
    assert store.manifest("episodes", 9, 9) is None
    df = store.read_table("episodes", columns=["episode_id", "iteration", "stage"])
    assert list(df.columns) == ["episode_id", "iteration", "stage"]
    assert sorted(zip(df["stage"], df["iteration"])) == expect
    only_keys = store.read_table("episodes", stage=1, columns=["stage"])
    assert only_keys["stage"].tolist() == [1, 1, 1]
    assert store.read_table("episodes", stage=7).empty
    assert list(store.read_table("episodes", stage=7).columns) == EPISODES_SCHEMA.names
    with pytest.raises(ValueError, match="unknown table"):
        store.read_table("nope")
    with pytest.raises(ValueError, match="no column"):
        store.read_table("episodes", columns=["nope"])


# ---------------------------------------------------------------------------- commits
def test_commit_idempotent_rerun(store, tmp_path):
    eps = [make_episode(i) for i in range(3)]
    m1 = store.write_episodes(eps, stage=1, iteration=0, global_step=1, policy_version=1)
    files_before = shards(tmp_path / "store")
    commit_files = sorted((tmp_path / "store" / RUN / "_commits").rglob("*"))
    # a re-run of the same iteration (even with other content) returns the first commit
    m2 = store.write_episodes([make_episode(i, seed=5) for i in range(5)], stage=1, iteration=0,
                              global_step=1, policy_version=1)
    assert m2 == m1
    assert shards(tmp_path / "store") == files_before
    assert sorted((tmp_path / "store" / RUN / "_commits").rglob("*")) == commit_files
    assert len(store.read_table("episodes")) == 3 and len(store.read_table("turns")) == 6
    assert [e.episode_id for e in store.read_episodes(1, 0)] == [e.episode_id for e in eps]
    # a second store object on the same root sees the same commit
    other = TrajectoryStore(str(tmp_path / "store"), RUN)
    assert other.manifest("episodes", 1, 0) == m1


def test_losing_writer_deletes_its_shards(store, tmp_path, monkeypatch):
    """Two writers race: the one that commits second keeps nothing of its own."""
    m1 = store.write_episodes([make_episode(0)], stage=1, iteration=0, global_step=0,
                              policy_version=0)
    late = TrajectoryStore(str(tmp_path / "store"), RUN)
    real = late.manifest
    calls = {"n": 0}

    def blind_first(table, stage, iteration):  # the late writer's early check misses the commit
        calls["n"] += 1
        return None if calls["n"] == 1 else real(table, stage, iteration)

    monkeypatch.setattr(late, "manifest", blind_first)
    m2 = late.write_episodes([make_episode(i) for i in range(4)], stage=1, iteration=0,
                             global_step=0, policy_version=0)
    assert m2 == m1
    assert sorted(p.name for p in shards(tmp_path / "store")) == sorted(
        Path(f).name for f in m1.files + m1.extra["turns"]["files"]
    )
    assert len(store.read_table("episodes")) == 1
    assert len(pd.read_parquet(store.path("episodes"))) == 1


def test_orphan_and_hidden_shards_ignored(store, tmp_path):
    store.write_episodes([make_episode(i) for i in range(2)], stage=1, iteration=0,
                         global_step=0, policy_version=0)
    root = tmp_path / "store" / RUN / "episodes"
    valid = pq.read_table(shards(tmp_path / "store", "episodes")[0])
    # a killed writer's leftovers: a renamed-but-uncommitted shard in a committed partition,
    # a shard in a partition with no commit, and hidden temp files (one garbage)
    pq.write_table(valid, root / "stage=1" / "iteration=0" / "part-orphan.parquet")
    (root / "stage=4" / "iteration=0").mkdir(parents=True)
    pq.write_table(valid, root / "stage=4" / "iteration=0" / "part-orphan.parquet")
    (root / "stage=1" / "iteration=0" / ".tmp-dead.parquet").write_bytes(b"not parquet")
    (root / "stage=1" / "iteration=0" / "_tmp-dead.parquet").write_bytes(b"not parquet")

    df = store.read_table("episodes")
    assert len(df) == 2 and set(df["stage"]) == {1}
    assert len(store.read_episodes(1, 0)) == 2
    assert store.read_table("episodes", stage=4).empty
    # raw pandas skips the hidden files (it would choke on them otherwise) but not orphans
    assert len(pd.read_parquet(root)) == 6


def test_rerun_after_crash_cleans_uncommitted_shards(store, tmp_path):
    """A writer killed between rename and commit leaves a part file; the re-run removes it."""
    store.write_episodes([make_episode(0)], stage=1, iteration=0, global_step=0, policy_version=0)
    part_dir = tmp_path / "store" / RUN / "episodes" / "stage=1" / "iteration=1"
    part_dir.mkdir(parents=True)
    pq.write_table(pq.read_table(shards(tmp_path / "store", "episodes")[0]),
                   part_dir / "part-killed.parquet")
    m = store.write_episodes([make_episode(i) for i in range(3)], stage=1, iteration=1,
                             global_step=1, policy_version=1)
    assert not (part_dir / "part-killed.parquet").exists()
    assert [f"episodes/stage=1/iteration=1/{p.name}" for p in part_dir.iterdir()] == m.files
    assert len(pd.read_parquet(store.path("episodes"), filters=[("iteration", "=", 1)])) == 3


def test_missing_turns_commit_recovered(store, tmp_path):
    """Crash after the episodes commit, before the turns commit file: readers still see turns
    (the episodes manifest embeds them) and a re-run writes the file."""
    m = store.write_episodes([make_episode(i) for i in range(2)], stage=1, iteration=0,
                             global_step=0, policy_version=0)
    turns_commit = tmp_path / "store" / RUN / "_commits" / "turns" / "1-0.json"
    saved = json.loads(turns_commit.read_text())
    turns_commit.unlink()
    assert store.is_committed("turns", 1, 0)
    assert [(c.stage, c.iteration) for c in store.commits("turns")] == [(1, 0)]
    assert len(store.read_table("turns")) == 4
    assert store.write_episodes([make_episode(9)], stage=1, iteration=0, global_step=0,
                                policy_version=0) == m
    assert json.loads(turns_commit.read_text()) == saved


# ---------------------------------------------------------------------------- integrity
def test_sha256_mismatch_raises(store, tmp_path):
    store.write_episodes([make_episode(i) for i in range(2)], stage=1, iteration=0,
                         global_step=0, policy_version=0)
    (f,) = shards(tmp_path / "store", "turns")
    # replace with a *valid* Parquet file of other content: only the hash can tell
    t = pq.read_table(f)
    pq.write_table(t.slice(0, 1), f)
    with pytest.raises(StoreError, match=f.name):
        store.read_table("turns")
    with pytest.raises(StoreError, match="sha256 mismatch"):
        store.read_episodes(1, 0)
    assert len(store.read_table("episodes")) == 2  # the other table is untouched
    # a flipped byte
    (g,) = shards(tmp_path / "store", "episodes")
    data = bytearray(g.read_bytes())
    data[len(data) // 2] ^= 0xFF
    g.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=g.name):
        store.read_table("episodes")
    # a deleted file
    g.unlink()
    with pytest.raises(StoreError, match="missing"):
        store.read_table("episodes")


def test_corrupt_manifest_raises(store, tmp_path):
    store.write_episodes([make_episode(0)], stage=1, iteration=0, global_step=0, policy_version=0)
    commit = tmp_path / "store" / RUN / "_commits" / "episodes" / "1-0.json"
    d = json.loads(commit.read_text())
    d["sha256"][d["files"][0]] = "0" * 64  # hash edited without the combined digest
    commit.write_text(json.dumps(d))
    with pytest.raises(StoreError, match="digest"):
        store.read_table("episodes")
    commit.write_text("{ not json")
    with pytest.raises(StoreError, match="corrupt commit manifest"):
        store.manifest("episodes", 1, 0)
    commit.write_text(json.dumps({"table": "episodes"}))
    with pytest.raises(StoreError, match="malformed"):
        store.read_table("episodes")


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "breakage, match",
    [
        (lambda e: e.loss_mask.pop(), "differ in length"),
        (lambda e: setattr(e, "reward", 1.5), "outside"),
        (lambda e: setattr(e, "infra_error", True), "not scored"),  # an infra error with a reward of 0
        (lambda e: e.old_logprobs.__setitem__(0, -0.5), "masked token"),
        (lambda e: setattr(e, "env", None), "null"),
        (lambda e: setattr(e, "episode_id", "s1-e0"), "duplicate"),
        (lambda e: setattr(e, "horizon", 2**40), "horizon"),
        (lambda e: e.input_ids.__setitem__(0, 2**31), "input_ids"),
        (lambda e: e.loss_mask.__setitem__(0, 2), "loss_mask"),
    ],
)
def test_invalid_episode_rejected_before_any_write(tmp_path, breakage, match):
    store = TrajectoryStore(str(tmp_path / "store"), RUN)
    eps = [make_episode(i) for i in range(3)]
    breakage(eps[1])  # a scored episode (eps[2] is the infra error)
    with pytest.raises(ValueError, match=match):
        store.write_episodes(eps, stage=1, iteration=0, global_step=0, policy_version=0)
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*"))
    assert not store.is_committed("episodes", 1, 0)


def test_bad_run_id_rejected(tmp_path):
    for bad in ("", "a/b", "_x", ".x"):
        with pytest.raises(ValueError):
            TrajectoryStore(str(tmp_path), bad)


# ---------------------------------------------------------------------------- advantages
def test_advantages_roundtrip_and_idempotent(store, tmp_path):
    rows = [
        {"episode_id": "s1-e0", "advantages": [0.5, -1.25, 0.1], "returns": [1.0, 0.0, 0.3]},
        {"episode_id": "s1-e1", "advantages": np.array([2.0], dtype=np.float64),
         "returns": (1.0,)},
        {"episode_id": "s1-e2", "advantages": [], "returns": []},
    ]
    m = store.write_advantages(rows, stage=1, iteration=3, estimator="grpo")
    assert (m.table, m.rows, m.extra["estimator"]) == ("advantages", 3, "grpo")
    t = store.read_arrow("advantages")
    assert t.schema.equals(ADVANTAGES_SCHEMA)
    df = store.read_table("advantages", stage=1, iteration=3)
    assert df["episode_id"].tolist() == ["s1-e0", "s1-e1", "s1-e2"]
    assert df["advantages"].iloc[0].tolist() == f32([0.5, -1.25, 0.1])
    assert df["returns"].iloc[1].tolist() == [1.0]
    assert df["advantages"].iloc[2].tolist() == []
    assert set(df["estimator"]) == {"grpo"}
    before = shards(tmp_path / "store")
    assert store.write_advantages(rows[:1], stage=1, iteration=3, estimator="gae") == m
    assert shards(tmp_path / "store") == before
    assert [(c.stage, c.iteration) for c in store.commits("advantages")] == [(1, 3)]


@pytest.mark.parametrize(
    "row, match",
    [
        ({"episode_id": "a", "advantages": [1.0, 2.0], "returns": [1.0]}, "returns"),
        ({"episode_id": "a", "advantages": [float("nan")], "returns": [0.0]}, "non-finite"),
        ({"episode_id": "a", "advantages": [1e39], "returns": [0.0]}, "non-finite"),
        ({"episode_id": "a", "advantages": ["x"], "returns": [0.0]}, "advantages"),
        ({"episode_id": "", "advantages": [], "returns": []}, "episode_id"),
        ({"episode_id": "a", "advantages": []}, "lacks"),
    ],
)
def test_bad_advantages_rejected(tmp_path, row, match):
    store = TrajectoryStore(str(tmp_path / "store"), RUN)
    with pytest.raises(ValueError, match=match):
        store.write_advantages([row], stage=1, iteration=0, estimator="grpo")
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*"))


def test_empty_write_commits_zero_rows(store):
    m = store.write_episodes([], stage=1, iteration=0, global_step=0, policy_version=0)
    assert m.rows == 0 and store.is_committed("episodes", 1, 0)
    assert store.read_table("episodes").empty and store.read_episodes(1, 0) == []
    assert store.read_table("turns").empty


# ---------------------------------------------------------------------------- real S3
def test_s3_store_roundtrip(s3_server):
    import s3fs

    opts = s3_server["storage_options"]
    root = f"s3://{s3_server['bucket']}/stores"
    store = TrajectoryStore(root, RUN, storage_options=opts)
    assert store.path("turns") == f"s3://{s3_server['bucket']}/stores/{RUN}/turns"
    store.check_writable()

    eps = [make_episode(i) for i in range(3)]
    m = store.write_episodes(eps, stage=1, iteration=0, global_step=2, policy_version=1)
    store.write_episodes([make_episode(i, stage=2) for i in range(2)], stage=2, iteration=0,
                         global_step=3, policy_version=2)
    store.write_advantages([{"episode_id": "s1-e0", "advantages": [0.5], "returns": [1.0]}],
                           stage=1, iteration=0, estimator="grpo")

    back = store.read_episodes(1, 0)
    assert [b.input_ids for b in back] == [e.input_ids for e in eps]
    assert [b.old_logprobs for b in back] == [f32(e.old_logprobs) for e in eps]
    assert [b.turns for b in back] == [e.turns for e in eps]
    assert [(c.stage, c.iteration) for c in store.commits("episodes")] == [(1, 0), (2, 0)]

    # raw pandas over s3 with filters, no helper
    df = pd.read_parquet(store.path("turns"), filters=[("stage", "=", 2)], storage_options=opts)
    assert len(df) == 4 and set(df["stage"].astype(int)) == {2}
    assert len(pd.read_parquet(store.path("episodes"), storage_options=opts)) == 5

    # streaming: an aborted chunked writer leaves nothing; a chunked commit reads back whole
    with pytest.raises(RuntimeError, match="stop"):
        with store.episode_writer(stage=3, iteration=0, global_step=4, policy_version=3,
                                  chunk_episodes=2) as w:
            w.extend([make_episode(i, stage=3) for i in range(3)])
            raise RuntimeError("stop")
    fs0 = s3fs.S3FileSystem(**opts)
    for table in ("episodes", "turns"):  # no shard, staged or not (SeaweedFS keeps folder keys)
        left = fs0.find(f"{s3_server['bucket']}/stores/{RUN}/{table}/stage=3")
        assert not [p for p in left if p.endswith(".parquet")], left
    chunked = [make_episode(i, stage=3) for i in range(5)]
    with store.episode_writer(stage=3, iteration=0, global_step=4, policy_version=3,
                              chunk_episodes=2) as w:
        w.extend(chunked)
        m3 = w.commit()
    assert m3.rows == 5 and len(m3.files) == 3
    assert [b.input_ids for b in store.read_episodes(3, 0)] == [e.input_ids for e in chunked]
    assert len(pd.read_parquet(store.path("episodes"), filters=[("stage", "=", 3)],
                               storage_options=opts)) == 5

    # idempotent: a fresh store object (no caches) re-running the iteration gets the first commit
    fs = s3fs.S3FileSystem(**opts)
    before = sorted(fs.find(f"{s3_server['bucket']}/stores/{RUN}"))
    again = TrajectoryStore(root, RUN, storage_options=opts)
    assert again.write_episodes([make_episode(7)], stage=1, iteration=0, global_step=2,
                                policy_version=1) == m
    fs.invalidate_cache()
    assert sorted(fs.find(f"{s3_server['bucket']}/stores/{RUN}")) == before
    # the exclusive create itself refuses a second commit (If-None-Match on the server)
    path = again._commit_path("episodes", 1, 0)
    assert again._create_if_absent(path, b"{}") is False
    assert again.manifest("episodes", 1, 0) == m

    # corruption on S3 is detected too
    fs.pipe_file(f"{s3_server['bucket']}/stores/{RUN}/{m.files[0]}", b"garbage")
    with pytest.raises(StoreError, match=Path(m.files[0]).name):
        again.read_table("episodes", stage=1)
    assert len(again.read_table("episodes", stage=2)) == 2


def test_s3_rejects_bad_credentials(s3_server):
    opts = {**s3_server["storage_options"], "secret": "wrong"}
    store = TrajectoryStore(f"s3://{s3_server['bucket']}/stores", RUN, storage_options=opts)
    with pytest.raises(PermissionError):
        store.write_episodes([make_episode(0)], stage=1, iteration=0, global_step=0,
                             policy_version=0)
    with pytest.raises(OSError, match="is not writable"):  # found before any rollout
        store.check_writable()


def test_train_batch_round_trip_keeps_order_and_optional_columns(tmp_path):
    from agentgym.store.trajectory_store import TrajectoryStore

    store = TrajectoryStore(str(tmp_path), "tb")
    rows = [{"episode_id": f"e{i}", "input_ids": list(range(3 + i)), "loss_mask": [0] * 2 + [1] * (1 + i),
             "old_logprobs": [0.0] * 2 + [-0.5] * (1 + i), "advantages": [0.0] * 2 + [0.25 * i] * (1 + i),
             "returns": [0.5] * (3 + i), "old_values": None} for i in (2, 0, 1)]
    batch = EpisodeBatch.from_rows(rows)
    m = store.write_train_batch(batch, stage=1, iteration=4)
    assert m.rows == 3 and store.write_train_batch(batch.select([True, False, False]), stage=1, iteration=4) == m  # idempotent
    back = store.read_train_batch(1, 4)
    assert back["episode_id"] == ["e2", "e0", "e1"]  # batch order
    for want, got in zip(rows, back.rows()):
        for c in ("input_ids", "loss_mask", "old_logprobs", "advantages", "returns"):
            assert list(got[c]) == pytest.approx(list(want[c])), c
    assert "old_values" not in back  # absent in every row: absent from the batch
    spec = store.spec()
    assert Path(spec["root"]).is_absolute() and TrajectoryStore(**spec).read_train_batch(1, 4) == back
    with pytest.raises(ValueError, match="advantages has 1 values for 3 tokens"):
        EpisodeBatch.from_rows([{**rows[1], "advantages": [0.0]}])


def test_an_unwritable_root_fails_the_check_naming_the_setting(tmp_path):
    from agentgym.store.trajectory_store import TrajectoryStore

    TrajectoryStore(str(tmp_path / "ok"), "w").check_writable()
    assert not [p for p in (tmp_path / "ok").rglob("*") if p.is_file()]  # the probe is gone
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(OSError, match=r"store.root .*file' is not writable for run 'w'.*set store.root"):
        TrajectoryStore(str(blocker), "w").check_writable()


@pytest.mark.parametrize("column,value,default", [("invalid_action", True, False), ("state_key", "babyai:s1", "")])
def test_datasets_written_before_a_column_was_added_still_read(store, tmp_path, column, value, default):
    """Additive schema evolution: a turns file without an added column (``invalid_action``,
    ``state_key``: written before it existed) reads with its default through read_table and
    read_episodes."""
    import hashlib

    from agentgym.store.manifest import combined_digest

    eps = [make_episode(i) for i in range(2)]
    setattr(eps[0].turns[1], column, value)
    store.write_episodes(eps, stage=1, iteration=0, global_step=0, policy_version=0)
    assert store.read_table("turns")[column].tolist() == [default, value, default, default]
    assert [getattr(t, column) for e in store.read_episodes(1, 0, turn_text=False) for t in e.turns] == \
        [default, value, default, default]
    (f,) = shards(tmp_path / "store", "turns")
    old = pq.read_table(f).drop_columns([column])  # the file as the old writer left it
    pq.write_table(old, f)
    commit = tmp_path / "store" / RUN / "_commits" / "turns" / "1-0.json"
    manifest = json.loads(commit.read_text())
    rel = next(iter(manifest["sha256"]))
    manifest["sha256"][rel] = hashlib.sha256(f.read_bytes()).hexdigest()
    manifest["digest"] = combined_digest(manifest["sha256"])
    commit.write_text(json.dumps(manifest))
    assert store.read_table("turns")[column].tolist() == [default] * 4
    assert [getattr(t, column) for e in store.read_episodes(1, 0) for t in e.turns] == [default] * 4
    # a column that was never added later is still an error, not a silent default
    pq.write_table(old.drop_columns(["reward"]), f)
    manifest["sha256"][rel] = hashlib.sha256(f.read_bytes()).hexdigest()
    manifest["digest"] = combined_digest(manifest["sha256"])
    commit.write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="reward"):
        store.read_table("turns")


# ---------------------------------------------------------------------------- streaming writes
def _published(root: Path) -> list[Path]:
    return sorted(p for p in (root / RUN).rglob("part-*.parquet"))


def _staged(root: Path) -> list[Path]:
    return sorted(p for p in (root / RUN).rglob(".tmp-*"))


def _commit_files(root: Path) -> list[Path]:
    return sorted((root / RUN / "_commits").rglob("*.json")) if (root / RUN / "_commits").exists() else []


def test_chunked_write_commits_once_and_equals_a_single_write(tmp_path):
    eps = [make_episode(i, n_turns=1 + i % 3) for i in range(10)]
    single = TrajectoryStore(str(tmp_path / "single"), RUN)
    single.write_episodes(eps, stage=1, iteration=0, global_step=4, policy_version=2)

    root = tmp_path / "chunked"
    store = TrajectoryStore(str(root), RUN)
    with store.episode_writer(stage=1, iteration=0, global_step=4, policy_version=2,
                              chunk_episodes=3) as w:
        for i, ep in enumerate(eps):
            w.add(ep)
            # before the commit nothing is visible: shards are hidden, no manifest exists
            assert not _published(root) and not _commit_files(root)
            assert store.read_table("episodes").empty
        assert len(_staged(root)) == 2 * 3  # 3 full chunks of 3, one per table, the 10th buffered
        m = w.commit()
    assert w.rows == 10 and m.rows == 10 and m.extra["chunks"] == 4 and len(m.files) == 4
    # exactly one commit per table, every shard published, none left hidden
    assert [p.relative_to(root / RUN / "_commits").as_posix() for p in _commit_files(root)] == \
        ["episodes/1-0.json", "turns/1-0.json"]
    assert len(_published(root)) == 8 and not _staged(root)

    # the same content as one write (created_at is the writer's own clock)
    def content(s: TrajectoryStore, table: str) -> pd.DataFrame:
        cols = [c for c in s.read_table(table).columns if c != "created_at"]
        return s.read_table(table, columns=cols)

    for table in ("episodes", "turns"):
        pd.testing.assert_frame_equal(content(store, table), content(single, table))
    assert [repr(e) for e in store.read_episodes(1, 0)] == [repr(e) for e in single.read_episodes(1, 0)]  # NaN reward
    # raw pandas over the folder sees every row once
    assert len(pd.read_parquet(store.path("episodes"))) == 10
    assert len(pd.read_parquet(store.path("turns"))) == sum(e.num_turns for e in eps)
    # a second writer for the committed iteration gets the first commit and leaves nothing
    with store.episode_writer(stage=1, iteration=0, global_step=4, policy_version=2,
                              chunk_episodes=2) as again:
        again.extend([make_episode(i, seed=9) for i in range(3)])
        assert again.commit() == m
    assert len(_published(root)) == 8 and not _staged(root)


def test_an_exception_between_chunks_commits_nothing_and_a_rerun_commits_cleanly(tmp_path):
    root = tmp_path / "store"
    store = TrajectoryStore(str(root), RUN)
    eps = [make_episode(i) for i in range(7)]
    with pytest.raises(RuntimeError, match="env server died"):
        with store.episode_writer(stage=1, iteration=0, global_step=0, policy_version=0,
                                  chunk_episodes=2) as w:
            w.extend(eps[:5])
            assert len(_staged(root)) == 4  # two chunks were written out
            raise RuntimeError("env server died")
    assert not store.is_committed("episodes", 1, 0) and not store.is_committed("turns", 1, 0)
    assert not _published(root) and not _staged(root) and not _commit_files(root)
    with pytest.raises(RuntimeError, match="aborted"):
        w.add(eps[5])

    # a process killed mid-iteration never reaches __exit__: its staged shards stay, hidden
    killed = store.episode_writer(stage=1, iteration=0, global_step=0, policy_version=0,
                                  chunk_episodes=2)
    killed.extend([make_episode(i, seed=3) for i in range(4)])
    assert len(_staged(root)) == 4 and not store.is_committed("episodes", 1, 0)
    assert store.read_table("episodes").empty
    for table in ("episodes", "turns"):  # raw readers skip hidden files too
        assert pq.ParquetDataset(store.path(table)).files == []

    # the re-run commits exactly its own episodes and removes the killed attempt's leftovers
    with store.episode_writer(stage=1, iteration=0, global_step=0, policy_version=0,
                              chunk_episodes=2) as w2:
        w2.extend(eps)
        m = w2.commit()
    assert m.rows == 7 and not _staged(root) and len(_published(root)) == 2 * 4
    assert [e.episode_id for e in store.read_episodes(1, 0)] == [e.episode_id for e in eps]
    assert len(pd.read_parquet(store.path("episodes"))) == 7


def test_a_bad_episode_in_a_later_chunk_leaves_nothing(tmp_path):
    root = tmp_path / "store"
    store = TrajectoryStore(str(root), RUN)
    with pytest.raises(ValueError, match="duplicate episode_id 's1-e1'"):
        with store.episode_writer(stage=1, iteration=0, global_step=0, policy_version=0,
                                  chunk_episodes=2) as w:
            w.extend([make_episode(0), make_episode(1), make_episode(2), make_episode(1)])
    assert not store.is_committed("episodes", 1, 0) and not _published(root) and not _staged(root)


# ---------------------------------------------------------------------------- schema evolution
def _rewrite_shard(root: Path, table: str, stage: int, iteration: int, change) -> Path:
    """Replace the one shard of a committed partition by ``change(pa.Table)`` and re-hash it in
    its manifest (as a hand-made file would be), so only the schema is wrong, not the digest."""
    import hashlib

    from agentgym.store.manifest import combined_digest

    (f,) = sorted((root / RUN / table / f"stage={stage}" / f"iteration={iteration}").glob("part-*"))
    pq.write_table(change(pq.read_table(f)), f)
    owner = "episodes" if table == "turns" else table  # turns' manifest is embedded in episodes'
    for path in {root / RUN / "_commits" / table / f"{stage}-{iteration}.json",
                 root / RUN / "_commits" / owner / f"{stage}-{iteration}.json"}:
        m = json.loads(path.read_text())
        inner = m["extra"]["turns"] if table == "turns" and path.parent.name == "episodes" else m
        rel = next(iter(inner["sha256"]))
        inner["sha256"][rel] = hashlib.sha256(f.read_bytes()).hexdigest()
        inner["digest"] = combined_digest(inner["sha256"])
        path.write_text(json.dumps(m))
    return f


def _retype(table: pa.Table, column: str, typ: pa.DataType) -> pa.Table:
    i = table.schema.get_field_index(column)
    return table.set_column(i, pa.field(column, typ), table.column(i).cast(typ))


def test_an_incompatible_column_type_names_column_file_types_and_fix(tmp_path):
    root = tmp_path / "store"
    store = TrajectoryStore(str(root), RUN)
    store.write_episodes([make_episode(i) for i in range(3)], stage=1, iteration=0,
                         global_step=0, policy_version=0)
    f = _rewrite_shard(root, "turns", 1, 0, lambda t: _retype(t, "reward", pa.string()))
    with pytest.raises(StoreError) as err:
        store.read_table("turns")
    msg = str(err.value)
    assert type(err.value).__name__ == "SchemaMismatch"
    assert "turns.reward" in msg and str(f) in msg
    assert "should be double" in msg and "the file has string" in msg
    assert "To fix: rewrite the file with reward converted to double" in msg
    with pytest.raises(StoreError, match="turns.reward"):  # every reader of the table
        store.read_episodes(1, 0)
    # narrowing fails too, even where today's values would fit: they are not guaranteed to
    _rewrite_shard(root, "turns", 1, 0, lambda t: _retype(_retype(t, "reward", pa.float64()),
                                                         "gen_tokens", pa.int64()))
    with pytest.raises(StoreError, match=r"turns.gen_tokens should be int32, the file has int64"):
        store.read_table("turns")
    # a reader asking for other columns is not blocked by the bad one
    assert len(store.read_table("turns", columns=["episode_id", "reward"])) == 6


def test_a_lossless_type_difference_reads_as_the_schema_type(tmp_path):
    root = tmp_path / "store"
    store = TrajectoryStore(str(root), RUN)
    eps = [make_episode(i) for i in range(3)]
    store.write_episodes(eps, stage=1, iteration=0, global_step=0, policy_version=0)
    want = store.read_table("episodes")

    def widen_the_other_way(t: pa.Table) -> pa.Table:  # older/other writers' narrower types
        t = _retype(t, "num_turns", pa.int16())
        t = _retype(t, "env", pa.large_string())
        return _retype(t, "old_logprobs", pa.large_list(pa.float32()))

    _rewrite_shard(root, "episodes", 1, 0, widen_the_other_way)
    got = store.read_arrow("episodes")
    assert got.schema == EPISODES_SCHEMA
    pd.testing.assert_frame_equal(got.to_pandas(), want)


def test_old_shards_lacking_an_added_column_read_as_nulls_with_pandas(tmp_path):
    """Users read a table folder with pd.read_parquet; a run whose first iteration predates
    ``turns.invalid_action`` gives nulls there (not a dropped column) with ``dataset_schema``."""
    root = tmp_path / "store"
    store = TrajectoryStore(str(root), RUN)
    old, new = [make_episode(i) for i in range(2)], [make_episode(i, stage=2) for i in range(2)]
    new[1].turns[0].invalid_action = True
    store.write_episodes(old, stage=1, iteration=0, global_step=0, policy_version=0)
    _rewrite_shard(root, "turns", 1, 0, lambda t: t.drop_columns(["invalid_action"]))
    store.write_episodes(new, stage=2, iteration=0, global_step=1, policy_version=1)

    df = pd.read_parquet(store.path("turns"), schema=store.dataset_schema("turns"))
    df = df.sort_values(["stage", "episode_id", "turn"], kind="stable")
    assert df.stage.tolist() == [1] * 4 + [2] * 4
    assert df[df.stage == 1].invalid_action.isna().all()  # unknown for old rows, not False
    assert df[df.stage == 2].invalid_action.tolist() == [False, False, True, False]
    filtered = pd.read_parquet(store.path("turns"), schema=store.dataset_schema("turns"),
                               filters=[("stage", "=", 1)])
    assert len(filtered) == 4 and filtered.invalid_action.isna().all()
    # the store's own readers give the column's default instead
    assert store.read_table("turns", stage=1).invalid_action.tolist() == [False] * 4


def _retract_round(store: TrajectoryStore, raw_read, opts=None) -> None:
    """Commit two iterations of every table, retract one, write it again."""
    for it in (0, 1):
        store.write_episodes([make_episode(i, seed=it) for i in range(3)], stage=1, iteration=it,
                             global_step=it, policy_version=it)
        store.write_advantages([{"episode_id": "s1-e0", "advantages": [0.5], "returns": [1.0]}],
                               stage=1, iteration=it, estimator="grpo")
    before = store.read_table("episodes", stage=1, iteration=1)
    withdrawn = store.retract(1, 1, ("train_batch", "advantages", "turns", "episodes"))
    assert withdrawn[0] == "advantages" and withdrawn[-1] == "episodes"  # dependents first; no train_batch
    assert [(c.stage, c.iteration) for c in store.commits("episodes")] == [(1, 0)]
    assert [(c.stage, c.iteration) for c in store.commits("advantages")] == [(1, 0)]
    assert not store.is_committed("turns", 1, 1)
    # raw readers see iteration 0 only (the retracted files sit under _retracted/)
    assert sorted(set(raw_read("episodes")["iteration"].astype(int))) == [0]
    assert sorted(set(raw_read("turns")["iteration"].astype(int))) == [0]
    # written again: the new commit, not the old one (a second retract finds nothing)
    store.write_episodes([make_episode(i, seed=7) for i in range(2)], stage=1, iteration=1,
                         global_step=1, policy_version=0)
    again = store.read_table("episodes", stage=1, iteration=1)
    assert len(again) == 2 and len(before) == 3
    assert sorted(raw_read("episodes").groupby("iteration", observed=True).size().tolist()) == [2, 3]
    assert store.retract(1, 5, ("episodes",)) == []


def test_retract_withdraws_an_iteration_and_keeps_its_files(store, tmp_path):
    _retract_round(store, lambda t: pd.read_parquet(store.path(t)))
    kept = sorted((tmp_path / "store" / RUN / "_retracted").rglob("*"))
    names = {p.name for p in kept}
    assert {"1-1.json"} <= names and any(n.endswith(".parquet") for n in names), names
    assert (tmp_path / "store" / RUN / "episodes" / "stage=1" / "iteration=1").is_dir()


def test_retract_on_s3(s3_server):
    opts = s3_server["storage_options"]
    store = TrajectoryStore(f"s3://{s3_server['bucket']}/retract", RUN, storage_options=opts)
    _retract_round(store, lambda t: pd.read_parquet(store.path(t), storage_options=opts))
