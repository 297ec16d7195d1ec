"""The SFT warm start inside the pipeline: demonstrations, SFT, the held-out table; SIGKILL in the
middle of the SFT stage, then a re-run with the run id: it resumes after the last finished epoch,
every SFT metric step is logged once, the demonstrations are committed once, and the summary has
the held-out rows random-valid, base, sft and one per stage."""

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from agentgym.tracking.open_client import open_client

from configs import DEFAULT, tiny_config  # tests/ is on sys.path

RUN = "sft-resume-test"
EPOCHS, EPISODES, BATCH = 3, 48, 4


def _config(tmp: Path, model_cache: str) -> Path:
    cfg = tiny_config(
        model_cache, store_root=tmp / "store", tracking_dir=tmp, run_id=RUN,
        envs=[{"name": "babyai", "tasks": [0, 1, 2, 4, 40, 41, 42, 44], "eval_tasks": [8000, 8001, 8002]}],
        rollout={"max_new_tokens": 10, "response_prefix": "Action:", "stop": ["\n"], "temperature": 0.3,
                 "max_draws": 2},
        trainer={"learning_rate": 1e-4, "micro_batch_size": 4, "bf16": DEFAULT},
        sft={"enabled": True, "episodes": EPISODES, "heldout_episodes": 4, "epochs": EPOCHS, "batch_size": BATCH,
             "learning_rate": 3e-3},
        heldout={"enabled": True, "horizon": 3, "random_seeds": 2},
        schedule={"stages": [{"horizon": 2, "iterations": 1}, {"horizon": 3, "iterations": 1}]},
        tracking={"experiment": "sft-resume"})
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(cfg: Path, tmp: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "agentgym_cli.cli", "train", "-c", str(cfg)], cwd=tmp,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, text=True)


def _sft_run(client: MlflowClient, exp: str):
    runs = client.search_runs([exp], filter_string=f"tags.`agentgym.run_id` = '{RUN}' and tags.`agentgym.kind` = 'sft'")
    return runs[0] if runs else None


@pytest.mark.slow
def test_sft_stage_resumes_after_sigkill(tmp_path, model_cache, tiny_path):
    cfg = _config(tmp_path, model_cache)
    proc = _train(cfg, tmp_path)
    # the child creates the same fresh DB now: open_client takes its migration lock (a bare
    # MlflowClient here once raced the child's schema migration and killed the run)
    client = open_client(f"sqlite:///{tmp_path}/mlflow.db")
    deadline = time.time() + 300
    # the first SFT epoch is checkpointed: kill the whole process group inside the next epochs
    while True:
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "the SFT stage never finished an epoch"
        exp = client.get_experiment_by_name("sft-resume") if (tmp_path / "mlflow.db").exists() else None
        run = _sft_run(client, exp.experiment_id) if exp else None
        if run is not None and "agentgym.sft_epoch_checkpoint" in run.data.tags:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    run = _sft_run(client, exp.experiment_id)
    assert "agentgym.last_checkpoint" not in run.data.tags, "the kill came after the SFT stage ended"

    second = _train(cfg, tmp_path)
    out, _ = second.communicate(timeout=600)
    assert second.returncode == 0, out
    run = _sft_run(client, exp.experiment_id)
    total = EPOCHS * -(-EPISODES // BATCH)
    steps = Counter(m.step for m in client.get_metric_history(run.info.run_id, "sft_loss"))
    assert sorted(steps) == list(range(1, total + 1)) and set(steps.values()) == {1}
    held = Counter(m.step for m in client.get_metric_history(run.info.run_id, "heldout_loss"))
    assert set(held.values()) == {1} and 0 in held and total in held
    assert run.data.tags["agentgym.stage_finished"] == "true"
    # the demonstrations were committed once (train and held-out parts), read like rollouts
    demos = [p for p in (tmp_path / "store").iterdir() if p.name.startswith("demos-")]
    assert len(demos) == 1
    assert sorted(p.name for p in (demos[0] / "_commits" / "episodes").iterdir()) == ["0-0.json", "0-1.json"]
    import pandas as pd

    assert len(pd.read_parquet(demos[0] / "episodes", filters=[("iteration", "=", 0)])) == EPISODES
    # the summary: SFT line and the held-out table's rows, each evaluation logged once
    assert "SFT warm start" in out
    for label in ("random-valid", "base", "sft", "stage-0", "stage-1"):
        assert label in out
    parent = client.search_runs([exp.experiment_id],
                                filter_string=f"tags.`agentgym.run_id` = '{RUN}' and tags.`agentgym.kind` = 'pipeline'")[0]
    for label in ("base", "sft", "stage-1"):
        hist = client.get_metric_history(parent.info.run_id, f"heldout-by-policy/{label}.overall.greedy_at_1")
        assert len(hist) == 1, (label, hist)
    # the family series follows the policy RL trains: the SFT start at step 0 (not the base model),
    # then each stage's end, each with the random baseline at the same step
    family = client.get_metric_history(parent.info.run_id, "heldout/greedy_at_1")
    assert sorted(m.step for m in family) == [0, 1, 2], family
    # the learning curve, redrawn after each stage's held-out evaluation
    assert "learning_curve.png" in [a.path for a in client.list_artifacts(parent.info.run_id)]
    assert "learning curve:" in out and "learning_curve.png" in out
