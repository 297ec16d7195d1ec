"""Disk full under Prefect's own database (SQLite in PREFECT_HOME) while `agentgym train` runs.

The CLI runs its flow against a temporary Prefect server whose database is
``PREFECT_HOME/prefect.db``. Here PREFECT_HOME is a small tmpfs, filled by another file once
the run has committed its first iteration. What happens (observed): training goes on -- its
Prefect tasks report their states as events sent in the background and Prefect's log shipping
only prints "Error logging to API" -- and every iteration is committed and checkpointed; then the stage flow's end (its table artifact, its
final state) gets HTTP 500 from the server and the run fails. Prefect alone reported
``PrefectHTTPStatusError: Server error '500 Internal Server Error' for url .../set_state``;
``agentgym/tracking/prefect_db.py`` names the database, the free space and the settings instead.
With space again, ``--run-id`` resumes at the step it reached and repeats nothing.
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from agentgym.tracking.tracker import Tracker
from configs import tiny_config  # tests/ is on sys.path
from diskfull import fill, tmpfs

pytestmark = pytest.mark.timeout(900)  # a hang guard: two CLI runs on a loaded 2-core machine

RUN = "pfull"


def _train(cfg: Path, cwd: Path, home: Path, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # the temporary server
    env.update(PREFECT_HOME=str(home), PYTHONUNBUFFERED="1", COLUMNS="400",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="300")  # migrations, when run alone
    env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
    env.pop("PREFECT_SERVER_DATABASE_CONNECTION_URL", None)
    return subprocess.Popen([sys.executable, "-m", "agentgym_cli.cli", "train", "-c", str(cfg), *extra],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _drop_wal_slack(db: Path) -> None:
    """Checkpoint Prefect's WAL into the database and truncate it to 0 bytes. Why: in WAL mode
    SQLite reuses its WAL file after each checkpoint, so on a disk filled at a random moment the
    server's writes may fit in that file's old frames for a while (a 2-iteration run then
    finished unharmed; a 6-iteration one failed at its stage's end). Without the slack, the
    next write after the fill needs new space, as it does once the slack is used up."""
    con = sqlite3.connect(db, timeout=60)
    try:
        for _ in range(100):
            busy, _, _ = con.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            if not busy:
                break
            time.sleep(0.05)
        assert not busy, "Prefect's server never let the WAL be checkpointed"
    finally:
        con.close()


def _commits(store: Path) -> dict[str, bytes]:
    return {p.relative_to(store).as_posix(): p.read_bytes()
            for p in sorted((store / RUN / "_commits").rglob("*.json"))}


def _session_prefect_db() -> Path | None:
    """This test session's own Prefect database (tests/conftest.py's PREFECT_HOME), if the
    session's flow tests made it: copied, it spares the CLI under test Prefect's migrations, the
    slowest part of its start. Run alone, the CLI migrates a fresh one."""
    from agentgym.tracking.prefect_db import prefect_database

    src = prefect_database()
    return src if src is not None and src.exists() else None


@pytest.mark.slow  # two `agentgym train` processes, each starting its own Prefect server
def test_a_full_prefect_database_fails_clearly_and_a_rerun_resumes(mlflow_dir, model_cache, tiny_path):
    tmp = mlflow_dir  # holds a ready mlflow.db: the CLI does not run MLflow's migrations again
    cfg = tiny_config(
        model_cache, store_root=tmp / "store", tracking_dir=tmp, run_id=RUN,
        envs=[{"name": "keyword", "tasks": [0, 1, 2, 3], "kwargs": {"target": "yes", "mode": "starts_with"}}],
        rollout={"max_context_tokens": 512}, algorithm={"skip_tied_groups": False}, trainer={"micro_batch_size": 4},
        schedule={"stages": [{"horizon": 1, "iterations": 2}]}, tracking={"experiment": "pfull", "checkpoint_every": 1})
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    first_commit = tmp / "store" / RUN / "_commits" / "episodes" / "0-0.json"

    template = _session_prefect_db()
    copied_mb = sum(p.stat().st_size for p in template.parent.glob("prefect.db*")) >> 20 if template else 0
    with tmpfs(f"{64 + 2 * copied_mb}m") as disk:  # 64 MB for a fresh database and the run, + twice the copied one
        home = disk / "prefect"
        db = home / "prefect.db"
        home.mkdir()
        if template is not None:
            with sqlite3.connect(template, timeout=60) as a, sqlite3.connect(db) as b:
                a.backup(b)
        proc = _train(path, tmp, home)
        deadline = time.time() + 600
        while not first_commit.exists():  # the flow runs: fill Prefect's disk under it
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "the run never committed its first iteration"
            time.sleep(0.05)
        _drop_wal_slack(db)
        filler = fill(disk)
        out, _ = proc.communicate(timeout=600)

        assert proc.returncode == 1, out
        failed = re.search(r"run pfull failed: .*", out)
        assert failed, out
        msg = failed.group(0)
        assert msg.startswith(f"run pfull failed: OSError: [Errno 28] No space left on device: the Prefect "
                              f"database {db} could not be written"), msg
        assert "PREFECT_HOME" in msg and "PREFECT_API_DATABASE_CONNECTION_URL" in msg, msg
        assert f"--run-id {RUN}" in out  # the way back

        # Prefect's database survived the full disk (SQLite rolled the failed writes back)
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        con.close()
        # no training state lost: both iterations committed, the last checkpoint published
        commits = _commits(tmp / "store")
        assert {f"{RUN}/_commits/{t}/0-{i}.json" for t in ("episodes", "turns") for i in (0, 1)} <= set(commits)
        tracker = Tracker(cfg["tracking"]["tracking_uri"], "pfull")
        ckpt = tracker.latest_checkpoint(RUN)
        assert ckpt is not None and ckpt.global_step == 2, ckpt

        filler.unlink()  # space again: the same run resumes where it got to and repeats nothing
        rerun = _train(path, tmp, home, "--run-id", RUN)
        out, _ = rerun.communicate(timeout=600)
        assert rerun.returncode == 0, out
        assert "resumed at step 2" in out, out
        assert _commits(tmp / "store") == commits
        again = Tracker(cfg["tracking"]["tracking_uri"], "pfull")
        assert again.latest_checkpoint(RUN).artifact_uri == ckpt.artifact_uri
        parent = again.find_run(RUN, "pipeline")
        assert sorted(m.step for m in again.client.get_metric_history(parent, "reward_mean")) == [0, 1]


def test_only_a_prefect_failure_on_a_full_disk_is_named(monkeypatch, tmp_path):
    """The translation's two conditions, without a flow: a Prefect API failure, and the disk
    under the database nearly full. A 500 with room on the disk, or another error on a full
    disk, passes unchanged."""
    import errno

    import httpx
    from prefect.exceptions import PrefectHTTPStatusError

    from agentgym.tracking import prefect_db

    req = httpx.Request("POST", "http://127.0.0.1:9/api/flow_runs/x/set_state")
    resp = httpx.Response(500, request=req, json={"exception_message": "Internal Server Error"})
    http_500 = PrefectHTTPStatusError.from_httpx_error(httpx.HTTPStatusError("500", request=req, response=resp))
    monkeypatch.setattr(prefect_db, "prefect_database", lambda: tmp_path / "prefect.db")
    assert prefect_db.prefect_disk_error(http_500) is None  # room on the disk: another cause
    with tmpfs("1m") as disk:
        fill(disk)
        monkeypatch.setattr(prefect_db, "prefect_database", lambda: disk / "prefect.db")
        err = prefect_db.prefect_disk_error(http_500)
        assert err is not None and err.errno == errno.ENOSPC and err.__cause__ is http_500
        assert f"the Prefect database {disk / 'prefect.db'}" in str(err) and "HTTP 500" in str(err)
        assert prefect_db.prefect_disk_error(ValueError("not Prefect's")) is None
        monkeypatch.setattr(prefect_db, "prefect_database", lambda: None)  # a server elsewhere
        assert prefect_db.prefect_disk_error(http_500) is None
