"""With `tracking.checkpoint_trainer_state`, a run resumed from a checkpoint makes bit-identical
updates to the uninterrupted run (optimizer moments and RNG restored); without it, AdamW
restarts and the weights differ (which shows the test can tell)."""

import pytest
import torch

from agentgym.tracking.tracker import Tracker
from configs import keyword_env, parse_tiny_config  # tests/ is on sys.path
from tasks.rl import collect_rollouts, compute_advantages, restore_policy, save_checkpoint, update_policy
from tasks.runtime import drop_session, get_session


def _cfg(tmp_path, model_cache, keep_state: bool):
    return parse_tiny_config(
        model_cache, store_root=tmp_path / "store", tracking_dir=tmp_path, seed=5,
        envs=[keyword_env(tasks=[0, 1, 2, 3])], rollout={"group_size": 3}, algorithm={"ppo_epochs": 2},
        schedule={"stages": [{"horizon": 1, "iterations": 3}]},
        tracking={"experiment": "exact", "checkpoint_trainer_state": keep_state})


def _iteration(cfg, run_id, gs):
    collect_rollouts.fn(cfg, run_id, 0, gs, gs, 1)
    compute_advantages.fn(cfg, run_id, 0, gs, gs)
    update_policy.fn(cfg, run_id, 0, gs, gs)


def _weights(run_id):
    return {k: v.detach().clone() for k, v in get_session(None, run_id).trainer.module.named_parameters()}


@pytest.mark.parametrize("keep_state", [True, False])
def test_resumed_update_equals_uninterrupted(tmp_path, model_cache, keep_state):
    cfg = _cfg(tmp_path, model_cache, keep_state)
    run_id = f"exact-{keep_state}"
    cfg = cfg.model_copy(update={"run_id": run_id})
    tracker = Tracker(cfg.tracking.tracking_uri, cfg.tracking.experiment)
    parent = tracker.pipeline_run(run_id, cfg.model_dump(mode="json"))
    child = tracker.stage_run(parent, run_id, 0, 1, 3)
    assert restore_policy.fn(cfg, run_id)["start_step"] == 0
    for gs in range(2):
        _iteration(cfg, run_id, gs)
        save_checkpoint.fn(cfg, run_id, child, 0, gs + 1)
    # tracking.trainer_states_kept (default 1): step 1 kept its weights and lost its state
    states = {p.parent.name for p in tmp_path.rglob("checkpoints/step-*/trainer_state")}
    assert states == ({"step-000002"} if keep_state else set())
    _iteration(cfg, run_id, 2)  # the uninterrupted third update
    uninterrupted = _weights(run_id)

    drop_session(run_id)  # the process "dies" after the third update, before its checkpoint
    assert restore_policy.fn(cfg, run_id)["start_step"] == 2
    _iteration(cfg, run_id, 2)  # same committed batch, replayed from the checkpoint
    resumed = _weights(run_id)
    drop_session(run_id)
    same = all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)
    assert same is keep_state
