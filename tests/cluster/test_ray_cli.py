"""The command line on Ray: `agentgym train --set ray.address=local --set rollout.workers=2
--set trainer.world_size=2` trains the tiny model (an embedded cluster of the command's own on
127.0.0.1, two rank actors, two rollout workers), and its final checkpoint's weights differ
from the base model's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml
from safetensors.torch import load_file

from configs import keyword_env, tiny_config

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]


def _ray_processes(since: float) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline", "create_time"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["create_time"] >= since and ("raylet" in cmd or "gcs_server" in cmd or "ray::" in cmd):
            out.append(p)
    return out


def test_train_from_the_cli_with_two_ranks_and_two_rollout_workers(tmp_path, model_cache, tiny_path):
    import time

    cfg = tiny_config(model_cache, store_root=tmp_path / "store", tracking_dir=tmp_path, run_id="ray-cli",
                      envs=[keyword_env(tasks=[0, 1, 2, 3])],
                      rollout={"tasks_per_iteration": 4, "group_size": 2, "max_new_tokens": 6},
                      trainer={"micro_batch_size": 2},
                      schedule={"stages": [{"horizon": 1, "iterations": 2}]},
                      tracking={"experiment": "ray-cli", "checkpoint_every": 0})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "agentgym_cli.cli", "train", "-c", str(path), "--set", "ray.address=local",
         "--set", "rollout.workers=2", "--set", "trainer.world_size=2", "--set", "ray.num_cpus=4"],
        # without the loopback switch tests/cluster/conftest.py sets: the command must pin its
        # embedded cluster to 127.0.0.1 by itself
        cwd=tmp_path, env={**{k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"},
                           "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=540)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    import pandas as pd

    episodes = pd.read_parquet(tmp_path / "store" / "ray-cli" / "episodes")
    assert len(episodes) == 2 * 8
    # the second iteration was played by the workers on the weights of the first update
    assert set(episodes.loc[episodes["iteration"].astype(int) == 1, "policy_version"]) == {1}
    ckpt = re.search(r"checkpoint:\s*(\S+)", out)
    assert ckpt, out[-2000:]
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    local = Path(mlflow.artifacts.download_artifacts(ckpt.group(1), dst_path=str(tmp_path / "ckpt")))
    trained = load_file(next(local.rglob("model.safetensors")))
    base = load_file(Path(tiny_path) / "model.safetensors")
    changed = [k for k in base if k in trained and not (trained[k].float() == base[k].float()).all()]
    assert len(changed) > len(base) // 2, f"only {changed} changed"
    # the command's embedded cluster went with it (its actors exit on their own once the driver is
    # gone, which takes longer on a loaded machine: polled, not a fixed wait)
    deadline = time.monotonic() + 30
    while True:
        left = [p for p in _ray_processes(started) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert left == [], [" ".join(p.cmdline()) for p in left]
