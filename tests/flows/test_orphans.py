"""A killed `agentgym train` leaves no server behind.

The command is SIGKILLed mid-run on its own (not its process group: as `kill -9 PID` or the
kernel's OOM killer would), then every process it had started must end: its temporary Prefect
server above all, which Prefect's own ephemeral mode would leave running, orphaned (parent 1).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from configs import tiny_config  # tests/ is on sys.path

SERVER_APP = "prefect.server.api.server:create_app"


def _gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE  # dead, waiting for a parent that may never reap it
    except psutil.NoSuchProcess:
        return True


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return "?"


@pytest.mark.timeout(180)
def test_sigkilled_train_leaves_no_server(tmp_path, model_cache, tiny_path):
    cfg = tiny_config(model_cache, store_root=tmp_path / "store", tracking_dir=tmp_path, run_id="orphans",
                      schedule={"stages": [{"horizon": 1, "iterations": 3}, {"horizon": 2, "iterations": 3}]},
                      tracking={"experiment": "orphans"})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_UI_URL")}
    log = (tmp_path / "train.log").open("w")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "agentgym_cli.cli", "train", "-c", str(path)], cwd=tmp_path,
                            env={**env, "PYTHONUNBUFFERED": "1"}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own group: a leak cannot hide in pytest's
    cli = psutil.Process(proc.pid)
    first_commit = tmp_path / "store" / "orphans" / "_commits" / "episodes" / "0-0.json"
    children: list[psutil.Process] = []
    try:
        while not first_commit.exists():  # mid-run: the flow runs against the server
            assert proc.poll() is None, (tmp_path / "train.log").read_text()
            assert time.monotonic() - t0 < 150, "the run never committed its first rollout"
            time.sleep(0.05)
        children = cli.children(recursive=True)
        servers = [c for c in children if SERVER_APP in _cmdline(c)]
        assert servers, f"no Prefect server among the command's processes: {[_cmdline(c) for c in children]}"
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        left = children
        while left and time.monotonic() - killed < 20:
            left = [c for c in left if not _gone(c)]
            time.sleep(0.1)
        assert not left, [(c.pid, c.ppid(), _cmdline(c)) for c in left]
        print(f"MEASURED server gone {time.monotonic() - killed:.1f} s after the SIGKILL; "
              f"killed {killed - t0:.1f} s after the start")
    finally:
        if proc.poll() is None:
            proc.kill()
        for c in children:  # whatever outlived the check: never leave it to the next test
            try:
                c.kill()
            except psutil.Error:
                pass
        log.close()
