"""An S3 trajectory store whose bucket refuses writes for quota (SeaweedFS `weed mini`).

The bucket gets a 1 MB quota, a 1.2 MB object outside the run's prefix takes it over, and
``s3.bucket.quota.enforce -apply`` makes the bucket read-only, as SeaweedFS's own quota check
does. Then every PutObject / CopyObject is answered HTTP 500 ``InternalError`` (observed with
SeaweedFS 4.48; s3fs made it ``OSError: [Errno 121] We encountered an internal error, please try
again.``), while reads and deletes still work. The iteration being written fails with
``StoreWriteRefused`` naming the bucket, the object, the answer and the fix; nothing of it is
committed or left behind (no manifest, no shard, hidden or renamed); readers see the earlier
commit only; after the quota is raised the same write commits once.
"""

from __future__ import annotations

import errno
import json
import re
import time

import pandas as pd
import pytest

from agentgym.store.refusals import StoreWriteRefused
from agentgym.store.trajectory_store import TrajectoryStore
from seaweed import weed_shell
from test_disk_full import write

RUN = "quota"

pytestmark = pytest.mark.timeout(300)  # a hang guard


def _over_quota(server: dict, fs, bucket: str) -> None:
    """A 1 MB quota on ``bucket`` and a 1.2 MB object outside the run: over it, not yet enforced."""
    weed_shell(server, f"s3.bucket.quota -name={bucket} -op=set -sizeMB=1")
    fs.pipe_file(f"{bucket}/other/filler.bin", b"\0" * 1_200_000)
    deadline = time.time() + 60
    while (usage := _usage(server, bucket)) <= 100:  # the volume statistics lag a little
        assert time.time() < deadline, f"SeaweedFS never counted the filler against the quota ({usage}%)"
        time.sleep(0.5)


def _usage(server: dict, bucket: str) -> float:
    """The bucket's use of its quota in percent, as `s3.bucket.list` reports it."""
    out = weed_shell(server, "s3.bucket.list")
    m = re.search(rf"^\s*{re.escape(bucket)}\s.*usage:([0-9.]+)%", out, re.M)
    assert m, out
    return float(m.group(1))


def _enforce(server: dict) -> None:
    out = weed_shell(server, "s3.bucket.quota.enforce -apply")
    assert "read only" in out, out


def _objects(fs, prefix: str) -> list[str]:
    fs.invalidate_cache()
    return sorted(p.removeprefix(prefix + "/") for p in fs.find(prefix))


@pytest.mark.parametrize("refused_at", ["shard", "commit"])
def test_a_bucket_over_its_quota_refuses_cleanly_and_a_rerun_commits(s3_server, refused_at, monkeypatch):
    bucket = s3_server["bucket"]
    # botocore retries a 500 four times, with backoff, before it gives up; the answer is the same
    opts = {**s3_server["storage_options"], "config_kwargs": {"retries": {"total_max_attempts": 1}}}
    root = f"s3://{bucket}/{refused_at}"
    store = TrajectoryStore(root, RUN, storage_options=opts)
    write(store, 0)
    before = store.read_table("episodes").episode_id.tolist()
    prefix = f"{bucket}/{refused_at}/{RUN}"
    committed = _objects(store.fs, prefix)
    _over_quota(s3_server, store.fs, bucket)
    try:
        if refused_at == "shard":  # enforced before the iteration: its first shard is refused
            _enforce(s3_server)
        else:  # enforced after every shard was staged and renamed, before the commit manifest
            commit = store._commit
            monkeypatch.setattr(store, "_commit", lambda m: (_enforce(s3_server), commit(m))[1])

        with pytest.raises(StoreWriteRefused) as exc:
            write(store, 1)
        msg = str(exc.value)
        assert exc.value.errno == errno.EREMOTEIO, msg
        assert msg.startswith("[Errno 121] the object store refused to write "), msg
        what = "a episodes shard" if refused_at == "shard" else "a commit manifest"
        assert f"{what}" in msg and f"(bucket '{bucket}')" in msg and "HTTP 500 InternalError" in msg, msg
        assert "quota" in msg and "store.root" in msg and "--run-id" in msg, msg

        # nothing of iteration 1: no manifest, no shard (hidden or renamed) -- deletes still work
        assert store.manifest("episodes", 0, 1) is None
        assert _objects(store.fs, prefix) == committed
        # readers see iteration 0 only, through the store and raw
        assert store.read_table("episodes").episode_id.tolist() == before
        raw = pd.read_parquet(store.path("episodes"), storage_options=opts)
        assert sorted(raw.episode_id) == sorted(before) and set(raw.iteration.astype(int)) == {0}
    finally:
        monkeypatch.undo()
        out = weed_shell(s3_server, f"s3.bucket.quota -name={bucket} -op=set -sizeMB=100\n"
                                    "s3.bucket.quota.enforce -apply")  # quota raised: writable again
        store.fs.rm_file(f"{bucket}/other/filler.bin")
    assert "writable" in out, out

    m = write(store, 1)  # the re-run commits once
    assert m.rows == 6
    eps = store.read_table("episodes")
    assert eps.episode_id.tolist()[:len(before)] == before and len(eps) == len(before) + 6
    listed = {f for t in ("episodes", "turns") for f in
              json.loads(store.fs.cat_file(f"{prefix}/_commits/{t}/0-1.json"))["files"]}
    new = set(_objects(store.fs, prefix)) - set(committed)
    assert new == listed | {"_commits/episodes/0-1.json", "_commits/turns/0-1.json"}, new
