"""A training rank killed in the middle of a `trainer.world_size: 2` run: the update fails
with an error that names the rank, nothing is left running, and the next attempt (a re-run
with the same run id) starts a new resident group from the latest checkpoint and finishes."""

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

RUN_ID = "group-failure"


def _config(tmp: Path, model_cache: str) -> Path:
    cfg = tiny_config(model_cache, store_root=tmp / "store", tracking_dir=tmp, run_id=RUN_ID, seed=2,
                      trainer={"world_size": 2},
                      schedule={"stages": [{"horizon": 1, "iterations": 2}, {"horizon": 2, "iterations": 2}]},
                      tracking={"experiment": "group-failure", "checkpoint_every": 1})
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(cfg: Path, tmp: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "agentgym_cli.cli", "train", "-c", str(cfg)],
                            cwd=tmp, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, text=True)


def _ranks(pid: int) -> list[psutil.Process]:
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [p for p in kids if "agentgym.training.group.worker" in " ".join(_cmdline(p))]


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return []


@pytest.mark.slow
def test_killed_rank_fails_the_update_and_a_rerun_resumes_on_a_new_group(tmp_path, model_cache):
    cfg = _config(tmp_path, model_cache)
    commits = tmp_path / "store" / RUN_ID / "_commits" / "episodes"
    first = _train(cfg, tmp_path)
    deadline = time.time() + 300
    # step 1's episodes are committed: the group (started by step 0's update) is resident
    while not (commits / "0-1.json").exists() or len(_ranks(first.pid)) < 2:
        assert first.poll() is None, first.stdout.read()
        assert time.time() < deadline, "the first run never reached its second iteration"
        time.sleep(0.05)
    ranks = _ranks(first.pid)
    ranks[1].send_signal(signal.SIGKILL)
    out, _ = first.communicate(timeout=300)
    print(out[-3000:])
    assert first.returncode != 0, out
    assert re.search(r"training (rank \d of 2|group) failed", out), out
    assert f"--run-id {RUN_ID}" in out, "the error should say how to resume"
    _, alive = psutil.wait_procs(ranks, timeout=20)
    assert not alive, f"ranks left running: {alive}"
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("group-failure")
    runs = client.search_runs([exp.experiment_id], f"tags.`agentgym.run_id` = '{RUN_ID}'")
    status = {r.data.tags["agentgym.kind"] + r.data.tags.get("agentgym.stage", ""): r.info.status for r in runs}
    assert status["pipeline"] == "FAILED" and "FAILED" in [v for k, v in status.items() if k != "pipeline"]
    assert "RUNNING" not in status.values(), status  # the failed stage's run is closed too

    second = _train(cfg, tmp_path)
    out, _ = second.communicate(timeout=400)
    assert second.returncode == 0, out
    resumed = int(re.search(r"resumed at step (\d+)", out).group(1))
    assert 1 <= resumed <= 3  # the checkpoint the first run had saved before the kill

    parent = client.search_runs([exp.experiment_id], "tags.`agentgym.kind` = 'pipeline'")[0]
    stages = client.search_runs([exp.experiment_id], "tags.`agentgym.kind` = 'stage'")
    assert sorted(r.info.status for r in stages) == ["FINISHED", "FINISHED"]  # the failed one reopened
    assert sorted(m.step for m in client.get_metric_history(parent.info.run_id, "reward_mean")) == [0, 1, 2, 3]
    assert parent.info.status == "FINISHED"
