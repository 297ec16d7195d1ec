"""Disk full (ENOSPC) while the trajectory store writes an iteration, and while a checkpoint is
saved: the write fails with an error naming ENOSPC and the path, what was committed before stays
intact and readable, nothing (no hidden temp file, no uncommitted shard, no partial checkpoint
folder) is left behind, and the same write succeeds once there is space again.

The store is tested two ways: ``FullDiskFS`` (an fsspec filesystem with a byte budget; always
runs) and a real tmpfs that the kernel fills (skipped where ``mount`` is refused)."""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path

import pandas as pd
import pytest

from agentgym.store.trajectory_store import TrajectoryStore
from agentgym.types import Episode, Turn
from diskfull import FullDiskFS, fill, tmpfs

RUN = "full"
NO_SPACE = re.compile(r"\[Errno 28\] No space left on device: .+")

pytestmark = pytest.mark.timeout(300)  # a hang guard


def episode(i: int, stage: int) -> Episode:
    ep = Episode(episode_id=f"s{stage}-e{i}", group_id=f"g{i // 2}", env="keyword", task_id=i,
                 seed=i, horizon=2)
    ep.append(list(range(5, 40)), sampled=False)
    ep.append(list(range(40, 80 + i)), sampled=True, logprobs=[-1.0] * (40 + i))
    ep.turns = [Turn(turn=0, observation="x" * 300 + str(i), action_text=f"Action: say {i}",
                     parsed_action=f"say {i}", reward=1.0, terminated=True, truncated=False,
                     format_error=False, gen_tokens=40 + i, env_latency_ms=1.0)]
    ep.reward, ep.success, ep.terminated = 1.0, True, True
    return ep


def write(store: TrajectoryStore, iteration: int, n: int = 6, chunk: int = 2):
    with store.episode_writer(stage=0, iteration=iteration, global_step=iteration,
                              policy_version=iteration, chunk_episodes=chunk) as w:
        for i in range(n):
            w.add(episode(i, iteration))
        return w.commit()


def leftovers(run_dir: Path) -> list[str]:
    """Files no commit accounts for: hidden/staged files anywhere, and part-* shards that no
    manifest lists (visible to a raw ``pd.read_parquet`` although never committed)."""
    listed = set()
    for m in (run_dir / "_commits").rglob("[!.]*.json"):
        listed.update(json.loads(m.read_text())["files"])
    out = []
    for p in run_dir.rglob("*"):
        rel = p.relative_to(run_dir).as_posix()
        if p.is_file() and (p.name.startswith(".") or (p.name.startswith("part-") and rel not in listed)):
            out.append(rel)
    return sorted(out)


def check_full_disk_failure(store: TrajectoryStore, run_dir: Path, exc: pytest.ExceptionInfo, before) -> None:
    assert exc.value.errno == errno.ENOSPC
    msg = str(exc.value)
    assert NO_SPACE.match(msg) and str(run_dir) in msg and "store.root" in msg, msg
    assert store.manifest("episodes", 0, 1) is None  # iteration 1 is not committed ...
    assert leftovers(run_dir) == []  # ... and left nothing behind
    # iteration 0 is intact, through the store and through a raw reader
    assert store.read_table("episodes").episode_id.tolist() == before
    raw = pd.read_parquet(run_dir / "episodes")
    assert sorted(raw.episode_id) == sorted(before) and set(raw.iteration.astype(int)) == {0}


def check_rerun(store: TrajectoryStore, run_dir: Path, before) -> None:
    m = write(store, 1)
    assert m.rows == 6 and leftovers(run_dir) == []
    eps = store.read_table("episodes")
    assert eps.episode_id.tolist()[:len(before)] == before and len(eps) == len(before) + 6
    assert len(store.read_table("turns", iteration=1)) == 6


@pytest.mark.parametrize("budget_chunks", [0, 1])
def test_a_full_disk_during_a_shard_write_commits_nothing_and_a_rerun_commits(tmp_path, budget_chunks):
    """fsspec injection: the disk fills in the first chunk's shard, or after one chunk was
    staged (the staged shards of the earlier chunk must go too)."""
    store = TrajectoryStore(str(tmp_path), RUN)
    write(store, 0)
    before = store.read_table("episodes").episode_id.tolist()

    # how many bytes one chunk of iteration 1 takes, to let exactly that many through
    probe = TrajectoryStore(str(tmp_path / "probe"), RUN)
    with probe.episode_writer(stage=0, iteration=1, global_step=1, policy_version=1, chunk_episodes=2) as w:
        w.add(episode(0, 1))
        w.add(episode(1, 1))
        chunk_bytes = w.staged_bytes
    store.fs = FullDiskFS(budget=budget_chunks * chunk_bytes + 100)
    run_dir = tmp_path / RUN
    with pytest.raises(OSError) as exc:
        write(store, 1)
    assert store.fs.written > 0, "the write never reached the full disk"
    check_full_disk_failure(store, run_dir, exc, before)
    assert "shard" in str(exc.value)

    store.fs.budget = None  # space again
    check_rerun(store, run_dir, before)


@pytest.mark.parametrize("fills_before", ["shard", "commit"])
def test_a_real_full_disk_fails_the_write_cleanly(fills_before, monkeypatch):
    """A 2 MiB tmpfs filled by another file just before a shard write, or between the shard
    writes and the commit manifest (then the renamed shards must be removed again)."""
    with tmpfs("2m") as disk:
        root = disk / "store"
        store = TrajectoryStore(str(root), RUN)
        write(store, 0)
        before = store.read_table("episodes").episode_id.tolist()
        run_dir = root / RUN
        filler: list[Path] = []
        target = {"shard": "stage_shard", "commit": "_commit"}[fills_before]
        real = getattr(TrajectoryStore, target)

        def full_first(self, *a, **kw):
            if not filler:
                filler.append(fill(disk))
            return real(self, *a, **kw)

        monkeypatch.setattr(TrajectoryStore, target, full_first)
        with pytest.raises(OSError) as exc:
            write(store, 1)
        check_full_disk_failure(store, run_dir, exc, before)
        assert ("manifest" if fills_before == "commit" else "shard") in str(exc.value)

        filler[0].unlink()  # space again
        monkeypatch.undo()
        check_rerun(store, run_dir, before)
