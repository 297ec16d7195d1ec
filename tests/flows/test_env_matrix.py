"""Every environment runs through a full RL iteration by changing the config's envs line only,
and a mixed-environment batch trains."""

import pytest
import torch

from agentgym.pipeline import IterationRef, PolicySession
from configs import parse_tiny_config  # tests/ is on sys.path

ENVS = {
    "babyai": [0, 1, 2],
    "textcraft": [0, 1, 2],
    "sciworld": [0, 1396],
    "textworld": [0, 1],
    "deepsearch": [0, 1, 2],
    "keyword": [0, 1],
}


def _session(tmp_path, model_cache, envs, run):
    cfg = parse_tiny_config(
        model_cache, store_root=tmp_path / "store", envs=envs,
        rollout={"max_new_tokens": 12, "response_prefix": "Action:", "max_context_tokens": 4096},
        # an entropy bonus: a gradient even when every reward ties (a random model scores 0 on
        # most environments), so the update visibly trains on the environment's tokens
        algorithm={"skip_tied_groups": False, "entropy_coef": 0.01},
        schedule={"stages": [{"horizon": 2, "iterations": 1}]})
    return PolicySession(cfg, run)


def _iterate(session) -> dict:
    ref = IterationRef(0, 0, 0)
    before = {k: v.clone() for k, v in session.engine.model.state_dict().items()}
    out = {**session.collect(ref, horizon=2), **session.advantages(ref), **session.update(ref)}
    out["changed"] = any(not torch.equal(before[k], v) for k, v in session.engine.model.state_dict().items())
    return out


def _trained_on_the_episodes(session) -> None:
    """The update's batch (the store's train_batch table) is exactly this iteration's episodes,
    token for token: the environment's conversations, not some other data, were trained on."""
    eps = {e.episode_id: e for e in session.store.read_episodes(0, 0)}
    rows = session.store.read_train_batch(0, 0).rows()
    assert sorted(r["episode_id"] for r in rows) == sorted(eps)
    for r in rows:
        e = eps[r["episode_id"]]
        assert list(r["input_ids"]) == list(e.input_ids) and list(r["loss_mask"]) == list(e.loss_mask)


@pytest.mark.parametrize("env", sorted(ENVS))
def test_each_environment_by_one_config_line(tmp_path, model_cache, env):
    session = _session(tmp_path, model_cache, [{"name": env, "tasks": ENVS[env]}], f"matrix-{env}")
    out = _iterate(session)
    assert out["episodes"] == 4 and out["infra_error_episodes"] == 0 and out["turns_per_episode"] >= 1
    assert set(session.store.read_table("episodes")["env"]) == {env}
    _trained_on_the_episodes(session)
    # an optimizer step on a real gradient was taken and its weights reached the rollout engine
    assert out["optimizer_steps"] >= 1 and out["grad_norm"] > 0 and out["changed"]


def test_mixed_environment_batch_trains(tmp_path, model_cache):
    envs = [{"name": "babyai", "tasks": [0, 1]}, {"name": "textcraft", "tasks": [0, 1]},
            {"name": "keyword", "tasks": [0], "kwargs": {"target": "aeiou", "mode": "char_share"}}]
    session = _session(tmp_path, model_cache, envs, "matrix-mixed")
    session.cfg = session.cfg.model_copy(update={"rollout": session.cfg.rollout.model_copy(
        update={"tasks_per_iteration": 6})})
    out = _iterate(session)
    eps = session.store.read_table("episodes")
    assert set(eps["env"]) == {"babyai", "textcraft", "keyword"}
    _trained_on_the_episodes(session)
    assert out["changed"] and out["grad_norm"] > 0  # the char_share rewards give a real gradient
