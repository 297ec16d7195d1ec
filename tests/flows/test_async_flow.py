"""rollout.async_steps: 1 -- the next iteration's rollout plays while this one's update runs.

Checked on a real Prefect flow (temporary local server) with real MLflow: the staleness of every
update's batch (exactly one update behind, none at a stage's first iteration), the overlap in the
flow graph (the next collect_rollouts starts before this update_policy ends), the stage boundary
(no rollout at a stage's horizon before its stage), the PPO ratio taken against the sampler's
log-probs, and a SIGKILL + resume that commits each iteration once."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from mlflow.tracking import MlflowClient

from agentgym.config import parse_config
from configs import keyword_env, tiny_config  # tests/ is on sys.path

STAGES = [{"horizon": 1, "iterations": 3}, {"horizon": 2, "iterations": 3}]


def _cfg(tmp: Path, model_cache: str, run_id: str, async_steps: int = 1, stages: list = STAGES) -> dict:
    return tiny_config(
        model_cache, store_root=tmp / "store", tracking_dir=tmp, run_id=run_id, seed=2,
        envs=[keyword_env(eval_tasks=[7])],
        rollout={"tasks_per_iteration": 3, "async_steps": async_steps},
        algorithm={"skip_tied_groups": False, "mini_batches": 1, "ppo_epochs": 1},  # approx_kl: before any step
        schedule={"stages": stages}, tracking={"experiment": run_id, "eval_every": 2, "eval_k": 1})


def _stage0_tasks(flow_run_id) -> dict:
    """The task runs of a pipeline run's stage-0 subflow, by name."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with get_client(sync_client=True) as pc:
        subflows = pc.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))
        stage0 = next(f for f in subflows if f.name.startswith("stage-0"))
        return {t.name: t for t in pc.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [stage0.id]}))}


@pytest.fixture(scope="module")
def run(tmp_path_factory, model_cache):
    from flows.train import scaling_inter_rl

    tmp = tmp_path_factory.mktemp("async")
    cfg = parse_config(_cfg(tmp, model_cache, "async-test"))
    state = scaling_inter_rl(cfg, return_state=True)
    return cfg, state.result(), state.state_details.flow_run_id, tmp


def test_each_update_trains_on_the_policy_one_update_older(run):
    cfg, result, _, tmp = run
    ep = pd.read_parquet(tmp / "store" / "async-test" / "episodes")
    sampled_by = ep.groupby(["stage", "iteration"])["policy_version"].agg(["min", "max"])
    assert (sampled_by["min"] == sampled_by["max"]).all()  # one policy per rollout
    version = {k: int(v) for k, v in sampled_by["min"].items()}
    # the update of global step g runs at version g; its batch was sampled at g (a stage's first
    # iteration: synchronous) or g - 1 (played during the previous update)
    assert version == {(0, 0): 0, (0, 1): 0, (0, 2): 1, (1, 0): 3, (1, 1): 3, (1, 2): 4}
    client = MlflowClient(cfg.tracking.tracking_uri)
    stale = {m.step: m.value for m in client.get_metric_history(result["mlflow_run_id"], "staleness")}
    assert stale == {0: 0, 1: 1, 2: 1, 3: 0, 4: 1, 5: 1}
    # every rollout of a stage plays at that stage's horizon
    for stage, spec in enumerate(STAGES):
        assert (ep.loc[ep.stage == stage, "horizon"] == spec["horizon"]).all()


def test_the_ratio_is_taken_against_the_samplers_logprobs(run):
    """The update's old log-probs are the engine's (stored), so a batch sampled one update ago
    starts off-policy (ratio away from 1), while a synchronous one starts on it."""
    cfg, result, _, tmp = run
    batch = pd.read_parquet(tmp / "store" / "async-test" / "train_batch")
    ep = pd.read_parquet(tmp / "store" / "async-test" / "episodes").set_index("episode_id")
    for r in batch.itertuples():
        assert list(r.old_logprobs) == pytest.approx(list(ep.loc[r.episode_id, "old_logprobs"]))
    client = MlflowClient(cfg.tracking.tracking_uri)
    kl = {m.step: m.value for m in client.get_metric_history(result["mlflow_run_id"], "approx_kl")}
    assert min(kl[s] for s in (1, 2, 4, 5)) > max(10 * max(kl[s] for s in (0, 3)), 1e-6)


def test_the_next_rollout_overlaps_this_update_in_the_flow_graph(run):
    _, _, flow_run_id, _ = run
    tasks = _stage0_tasks(flow_run_id)
    update0 = tasks["update_policy[stage 0 it 0]"]
    collect1 = tasks["collect_rollouts[stage 0 h1 it 1]"]
    assert collect1.start_time < update0.end_time  # launched before the update ended
    assert "sync_policy[stage 0 it 1]" in tasks


def test_a_killed_async_run_resumes_with_each_iteration_once(tmp_path, model_cache):
    cfg = _cfg(tmp_path, model_cache, "async-kill")
    cfg["tracking"]["checkpoint_every"] = 1
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))

    def train() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "agentgym_cli.cli", "train", "-c", str(path)],
                                cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, text=True)

    commits = tmp_path / "store" / "async-kill" / "_commits" / "episodes"
    proc = train()
    deadline = time.time() + 300
    while not (commits / "1-1.json").exists():  # stage 1's second rollout, played ahead of its update
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "the first run never reached stage 1"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    second = train()
    out, _ = second.communicate(timeout=400)
    assert second.returncode == 0, out
    ep = pd.read_parquet(tmp_path / "store" / "async-kill" / "episodes")
    assert ep.groupby("stage")["iteration"].nunique().to_dict() == {0: 3, 1: 3}
    assert ep["episode_id"].is_unique and len(ep) == 6 * 3 * 2
    assert sorted(p.name for p in commits.iterdir()) == [f"{s}-{i}.json" for s in (0, 1) for i in range(3)]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    parent = client.search_runs([client.get_experiment_by_name("async-kill").experiment_id],
                                "tags.`agentgym.kind` = 'pipeline'")[0]
    steps = [m.step for m in client.get_metric_history(parent.info.run_id, "staleness")]
    assert sorted(steps) == list(range(6))  # every update once
    assert all(m.value <= 1 for m in client.get_metric_history(parent.info.run_id, "staleness"))


def test_async_refuses_recomputed_old_logprobs():
    with pytest.raises(ValueError, match="recompute_old_logprobs: false"):
        parse_config({"rollout": {"async_steps": 1}, "algorithm": {"recompute_old_logprobs": True}})
    with pytest.raises(ValueError, match="async_steps"):
        parse_config({"rollout": {"async_steps": 9}})


def test_two_steps_ahead_chains_the_rollouts_and_bounds_staleness_by_two(tmp_path, model_cache):
    """async_steps: 2 -- two rollouts queued ahead, each synced at its start after the one
    before it ends (a chain in the flow graph); no update trains on a batch more than two
    updates old; the stage's last rollouts are never played past it; eval drains the queue."""
    from flows.train import scaling_inter_rl

    stages = [{"horizon": 1, "iterations": 5}, {"horizon": 2, "iterations": 2}]
    cfg = parse_config(_cfg(tmp_path, model_cache, "async-two", async_steps=2, stages=stages))
    state = scaling_inter_rl(cfg, return_state=True)
    result = state.result()
    ep = pd.read_parquet(tmp_path / "store" / "async-two" / "episodes")
    assert ep.groupby("stage")["iteration"].nunique().to_dict() == {0: 5, 1: 2}
    assert ep["episode_id"].is_unique and len(ep) == 6 * 7
    client = MlflowClient(cfg.tracking.tracking_uri)
    stale = {m.step: m.value for m in client.get_metric_history(result["mlflow_run_id"], "staleness")}
    assert sorted(stale) == list(range(7)) and max(stale.values()) <= 2
    assert stale[0] == 0 and stale[5] == 0  # each stage's first rollout is synchronous
    versions = ep.groupby(["stage", "iteration"])["policy_version"].min()
    assert versions[(1, 0)] == 5  # the next stage starts on the last update of the one before
    for stage, spec in enumerate(stages):
        assert (ep.loc[ep.stage == stage, "horizon"] == spec["horizon"]).all()
    tasks = _stage0_tasks(state.state_details.flow_run_id)
    # iteration 2's rollout was queued at iteration 0: its sync waits for iteration 1's rollout,
    # and the rollout for the sync
    upstream = {str(i.id) for i in tasks["sync_policy[stage 0 it 2]"].task_inputs["wait_for"]}
    assert str(tasks["collect_rollouts[stage 0 h1 it 1]"].id) in upstream
    upstream = {str(i.id) for i in tasks["collect_rollouts[stage 0 h1 it 2]"].task_inputs["wait_for"]}
    assert str(tasks["sync_policy[stage 0 it 2]"].id) in upstream
    assert tasks["collect_rollouts[stage 0 h1 it 2]"].start_time < tasks["update_policy[stage 0 it 1]"].end_time
