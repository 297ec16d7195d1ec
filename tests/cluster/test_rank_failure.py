"""A training rank killed in the middle of a `trainer.world_size: 2` run of the command line:
the update fails with an error that names the rank, nothing of the run is left running (the
command's embedded Ray cluster goes with it), and the next attempt (a re-run with the same run
id) places a new group, resumes from the latest checkpoint and finishes.

The command starts its own cluster (``ray.address: null`` with world size 2: an embedded one on
127.0.0.1, ``agentgym.cluster.ray_runtime.ensure_ray``); the ranks are Ray worker processes
(``ray::TrainerRank...``), children of that cluster's raylet, itself a child of the command.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from mlflow.tracking import MlflowClient

from configs import tiny_config  # tests/ is on sys.path

pytestmark = pytest.mark.timeout(600)

RUN_ID = "group-failure"


def _config(tmp: Path, model_cache: str) -> Path:
    # 4 logical CPUs: two ranks and one rollout worker ask for one each (the machine has 2 cores)
    cfg = tiny_config(model_cache, store_root=tmp / "store", tracking_dir=tmp, run_id=RUN_ID, seed=2,
                      trainer={"world_size": 2}, ray={"num_cpus": 4},
                      schedule={"stages": [{"horizon": 1, "iterations": 2}, {"horizon": 2, "iterations": 1}]},
                      tracking={"experiment": "group-failure", "checkpoint_every": 1})
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(cfg: Path, tmp: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "agentgym_cli.cli", "train", "-c", str(cfg)],
                            cwd=tmp, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, text=True)


Seen = dict[tuple[int, float], tuple[psutil.Process, str]]


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return ""


def _observe(pid: int, seen: Seen) -> Seen:
    """Add the processes below ``pid`` (its Ray cluster: GCS, raylet, workers) to ``seen``, by
    (pid, start time), each with the last command line it showed (a Ray worker renames itself:
    ``ray::IDLE``, then ``ray::TrainerRank...`` once it holds a rank)."""
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return seen
    for p in kids:
        try:
            key = (p.pid, p.create_time())
        except psutil.NoSuchProcess:
            continue
        cmd = _cmdline(p)
        if cmd or key not in seen:
            seen[key] = (p, cmd)
    return seen


def _ranks(seen: Seen) -> list[psutil.Process]:
    return [p for p, cmd in seen.values() if "TrainerRank" in cmd]


def _running(seen: Seen) -> list[str]:
    """Those of ``seen`` still running (the same process: pid and start time; zombies count as gone)."""
    left = []
    for (pid, created), (p, cmd) in seen.items():
        try:
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {cmd[:120]}")
        except psutil.NoSuchProcess:
            pass
    return left


def _finish(proc: subprocess.Popen, timeout: float, seen: Seen) -> str:
    """Wait for the command to exit, adding every process seen below it meanwhile to ``seen``;
    its output."""
    deadline = time.time() + timeout
    while proc.poll() is None:
        assert time.time() < deadline, "the command did not exit"
        _observe(proc.pid, seen)
        time.sleep(0.1)
    out, _ = proc.communicate()
    return out


def test_killed_rank_fails_the_update_and_a_rerun_resumes_on_a_new_group(tmp_path, model_cache, tiny_path):
    cfg = _config(tmp_path, model_cache)
    commits = tmp_path / "store" / RUN_ID / "_commits" / "episodes"
    first = _train(cfg, tmp_path)
    deadline = time.time() + 300
    seen: Seen = {}
    # step 1's episodes are committed: the group (started by step 0's update) is resident
    while not (commits / "0-1.json").exists() or len(_ranks(seen)) < 2:
        assert first.poll() is None, first.stdout.read()
        assert time.time() < deadline, "the first run never reached its second iteration"
        _observe(first.pid, seen)
        time.sleep(0.05)
    ranks = _ranks(seen)
    assert any("raylet" in cmd for _, cmd in seen.values())  # the command's own cluster
    ranks[1].send_signal(signal.SIGKILL)
    out = _finish(first, 300, seen)
    print(out[-3000:])
    assert first.returncode != 0, out
    assert re.search(r"training group \(2 ranks\) failed in train_from_store: rank [01] died", out), out
    assert f"--run-id {RUN_ID}" in out, "the error should say how to resume"
    _, alive = psutil.wait_procs(ranks, timeout=20)
    assert not alive, f"ranks left running: {alive}"
    time.sleep(1)
    assert _running(seen) == []  # the command's exit took its cluster down: no GCS, raylet, worker
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("group-failure")
    runs = client.search_runs([exp.experiment_id], f"tags.`agentgym.run_id` = '{RUN_ID}'")
    status = {r.data.tags["agentgym.kind"] + r.data.tags.get("agentgym.stage", ""): r.info.status for r in runs}
    assert status["pipeline"] == "FAILED" and "FAILED" in [v for k, v in status.items() if k != "pipeline"]
    assert "RUNNING" not in status.values(), status  # the failed stage's run is closed too

    second = _train(cfg, tmp_path)
    seen = {}
    out = _finish(second, 400, seen)
    assert second.returncode == 0, out
    resumed = int(re.search(r"resumed at step (\d+)", out).group(1))
    assert 1 <= resumed <= 2  # the checkpoint the first run had saved before the kill
    assert len(_ranks(seen)) >= 2  # a new group of rank actors trained the rest
    time.sleep(1)
    assert _running(seen) == []

    parent = client.search_runs([exp.experiment_id], "tags.`agentgym.kind` = 'pipeline'")[0]
    stages = client.search_runs([exp.experiment_id], "tags.`agentgym.kind` = 'stage'")
    assert sorted(r.info.status for r in stages) == ["FINISHED", "FINISHED"]  # the failed one reopened
    assert sorted(m.step for m in client.get_metric_history(parent.info.run_id, "reward_mean")) == [0, 1, 2]
    assert parent.info.status == "FINISHED"
