"""Kill -9 a training run in the middle of stage 2, re-run it with the same run id: the result
has the same iterations per stage as an uninterrupted run, the right horizon everywhere, and no
duplicated trajectory commits or MLflow metric steps."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from mlflow.tracking import MlflowClient

from configs import keyword_env, tiny_config  # tests/ is on sys.path

ROOT = Path(__file__).resolve().parents[2]
STAGES = [{"horizon": 1, "iterations": 2}, {"horizon": 2, "iterations": 4}, {"horizon": 3, "iterations": 1}]


def _config(tmp: Path, model_cache: str, checkpoint_every: int = 1) -> Path:
    cfg = tiny_config(
        model_cache, store_root=tmp / "store", tracking_dir=tmp, run_id="resume-test", seed=3,
        envs=[keyword_env(eval_tasks=[7]), {"name": "keyword", "tasks": [3, 4], "kwargs": {"target": "yes"}}],
        rollout={"tasks_per_iteration": 3}, schedule={"stages": STAGES},
        tracking={"experiment": "resume", "checkpoint_every": checkpoint_every, "eval_every": 2, "eval_k": 1})
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(cfg: Path, tmp: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "agentgym_cli.cli", "train", "-c", str(cfg)],
                            cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)


@pytest.mark.slow
def test_sigkill_mid_stage_two_then_resume(tmp_path, model_cache):
    cfg = _config(tmp_path, model_cache)
    commits = tmp_path / "store" / "resume-test" / "_commits" / "episodes"
    proc = _train(cfg, tmp_path)
    deadline = time.time() + 300
    # stage 2 (index 1) has committed its second iteration: kill the whole process group
    while not (commits / "1-1.json").exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "first run never reached stage 2"
        time.sleep(0.02)  # poll well inside one tiny-model iteration (rollout_seconds + update_seconds)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

    second = _train(cfg, tmp_path)
    out, _ = second.communicate(timeout=400)
    assert second.returncode == 0, out
    resumed = int(re.search(r"resumed at step (\d+)", out).group(1))
    assert 2 < resumed < 6, f"the kill should land inside stage 2 (steps 2-5), resumed at {resumed}"

    episodes = pd.read_parquet(tmp_path / "store" / "resume-test" / "episodes")
    episodes["stage"] = episodes["stage"].astype(int)
    episodes["iteration"] = episodes["iteration"].astype(int)
    per_stage = episodes.groupby("stage")["iteration"].nunique().to_dict()
    assert per_stage == {0: 2, 1: 4, 2: 1}
    for stage, spec in enumerate(STAGES):
        assert (episodes.loc[episodes.stage == stage, "horizon"] == spec["horizon"]).all()
    # each (stage, iteration) committed once, with one batch of episodes
    assert len(episodes) == 7 * 3 * 2
    assert episodes["episode_id"].is_unique
    names = sorted(p.name for p in commits.iterdir())
    assert names == ["0-0.json", "0-1.json", "1-0.json", "1-1.json", "1-2.json", "1-3.json", "2-0.json"]

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("resume")
    parents = client.search_runs([exp.experiment_id], "tags.`agentgym.kind` = 'pipeline'")
    assert len(parents) == 1
    steps = [m.step for m in client.get_metric_history(parents[0].info.run_id, "reward_mean")]
    assert sorted(steps) == list(range(7))  # no step logged twice, none missing
    evals = [m.step for m in client.get_metric_history(parents[0].info.run_id, "eval/seconds")]
    assert sorted(evals) == [2, 4, 6]  # the validation loop neither repeated nor skipped
    horizons = {m.step: m.value for m in client.get_metric_history(parents[0].info.run_id, "horizon")}
    assert horizons == {0: 1, 1: 1, 2: 2, 3: 2, 4: 2, 5: 2, 6: 3}
    stages = client.search_runs([exp.experiment_id], "tags.`agentgym.kind` = 'stage'")
    assert sorted(r.data.params["horizon"] for r in stages) == ["1", "2", "3"]
    first_step = {"1": 0, "2": 2, "3": 6}
    for r in stages:  # each stage run: its own steps once each, and one lineage input per commit
        n = int(r.data.params["iterations"])
        start = first_step[r.data.params["horizon"]]
        assert sorted(m.step for m in client.get_metric_history(r.info.run_id, "reward_mean")) == \
            list(range(start, start + n))
        names = [i.dataset.name for i in client.get_run(r.info.run_id).inputs.dataset_inputs]
        assert sorted(names) == sorted(f"episodes/stage={r.data.params['stage']}/iteration={i}" for i in range(n))
    # the CLI's summary: the per-stage table, the run id and where everything is
    for line in ("ScalingInter-RL run resume-test", "run id:        resume-test (resumed at step",
                 "trajectories:", "MLflow:", "checkpoint:", "turns table:"):
        assert line in out, line
    assert all(r.data.tags.get("agentgym.stage_finished") == "true" for r in stages)


@pytest.mark.slow
def test_a_resume_from_the_stage_start_redoes_what_later_updates_sampled(tmp_path, model_cache):
    """checkpoint_every 0: the only checkpoint inside stage 2 is its start (step 2). Killed after
    stage 2's third rollout, the resumed run must not train on the rollouts of its second and
    third iterations (sampled by updates it redoes): they are retracted and rolled out again, and
    their metrics are logged again."""
    cfg = _config(tmp_path, model_cache, checkpoint_every=0)
    run = tmp_path / "store" / "resume-test"
    proc = _train(cfg, tmp_path)
    deadline = time.time() + 300
    while not (run / "_commits" / "episodes" / "1-2.json").exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "first run never reached stage 2's third iteration"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = pd.read_parquet(run / "episodes")
    sampled = before[before["stage"].astype(int) == 1].groupby("iteration", observed=True)["policy_version"].max()

    second = _train(cfg, tmp_path)
    out, _ = second.communicate(timeout=400)
    assert second.returncode == 0, out
    assert int(re.search(r"resumed at step (\d+)", out).group(1)) == 2

    episodes = pd.read_parquet(run / "episodes")
    episodes["iteration"] = episodes["iteration"].astype(int)
    assert episodes.groupby(episodes["stage"].astype(int))["iteration"].nunique().to_dict() == {0: 2, 1: 4, 2: 1}
    assert len(episodes) == 7 * 3 * 2 and episodes["episode_id"].is_unique
    # every iteration sampled by a policy no newer than its step's: none from a lost update
    last_version = episodes.groupby("global_step")["policy_version"].max()
    assert last_version.is_monotonic_increasing and (last_version <= last_version.index).all()
    retracted = sorted(p.name for p in (run / "_retracted").rglob("_commits/episodes/*.json"))
    # stage 2's first rollout was sampled by the restored checkpoint's policy; a later one
    # sampled by a newer version came from an update the resumed run redid
    assert retracted == [f"1-{i}.json" for i in (1, 2) if sampled[i] > sampled[0]] != []

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("resume")
    parent = client.search_runs([exp.experiment_id], "tags.`agentgym.kind` = 'pipeline'")[0]
    redone = [int(s) for s in parent.data.tags["agentgym.retracted_steps"].split(",")]
    assert redone == [2 + int(name[2]) for name in retracted]
    steps = sorted(m.step for m in client.get_metric_history(parent.info.run_id, "reward_mean"))
    assert set(steps) == set(range(7)) and all(steps.count(s) == 1 for s in range(7) if s not in redone)
    assert 3 not in redone or steps.count(3) == 2  # logged before the kill, and again


def test_resume_with_a_different_config_is_refused(tmp_path, model_cache):
    from agentgym.tracking.tracker import ResumeConflict, Tracker

    tracker = Tracker(f"sqlite:///{tmp_path}/m.db", "conflict")
    tracker.pipeline_run("r1", {"run_id": "r1", "trainer": {"learning_rate": 1e-3}})
    tracker.pipeline_run("r1", {"run_id": "r1", "trainer": {"learning_rate": 1e-3},
                                "tracking": {"tracking_uri": "elsewhere"}})  # allowed
    with pytest.raises(ResumeConflict, match="trainer.learning_rate"):
        tracker.pipeline_run("r1", {"run_id": "r1", "trainer": {"learning_rate": 5e-3}})


def test_a_step_logged_to_one_run_only_is_completed_without_doubling(tmp_path):
    """The kill can land between logging the stage run and the pipeline run: the resumed
    attempt fills in the pipeline run and leaves the stage run's step alone."""
    from agentgym.tracking.tracker import Tracker

    tracker = Tracker(f"sqlite:///{tmp_path}/m.db", "partial")
    parent = tracker.pipeline_run("r1", {"run_id": "r1"})
    child = tracker.stage_run(parent, "r1", 0, 2, 3)
    tracker.log_metrics(child, {"reward_mean": 0.5}, step=3)  # the killed attempt got this far

    written = tracker.log_metrics_once([child, parent], {"reward_mean": 0.75}, step=3)
    assert written == [parent]
    assert tracker.log_metrics_once([child, parent], {"reward_mean": 0.9}, step=3) == []
    history = {r: [(m.step, m.value) for m in tracker.client.get_metric_history(r, "reward_mean")]
               for r in (child, parent)}
    assert history == {child: [(3, 0.5)], parent: [(3, 0.75)]}


def test_an_evaluation_logged_before_the_kill_is_not_repeated(tmp_path, model_cache):
    """A kill after the step-2 evaluation but before the step-2 checkpoint: the resumed run
    replays the steps after its checkpoint and must not evaluate (and log) step 2 again."""
    from agentgym.config import parse_config
    from agentgym.tracking.tracker import Tracker
    from flows.train import scaling_inter_rl

    raw = yaml.safe_load(_config(tmp_path, model_cache).read_text())
    raw["schedule"] = {"stages": [{"horizon": 1, "iterations": 4}]}
    cfg = parse_config(raw)
    tracker = Tracker(cfg.tracking.tracking_uri, cfg.tracking.experiment)
    parent = tracker.pipeline_run(cfg.run_id, cfg.model_dump(mode="json"))
    tracker.log_metrics(parent, {"eval/seconds": -1.0}, step=2)  # what the killed attempt logged

    scaling_inter_rl(cfg)
    history = [(m.step, m.value) for m in tracker.client.get_metric_history(parent, "eval/seconds")]
    assert sorted(history)[0] == (2, -1.0) and [s for s, _ in sorted(history)] == [2, 4]
