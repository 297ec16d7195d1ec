"""Every environment runs through a full RL iteration by changing the config's envs line only,
and a mixed-environment batch trains."""

import pytest
import torch

from agentgym.config import parse_config
from agentgym.pipeline import IterationRef, PolicySession

ENVS = {
    "babyai": [0, 1, 2],
    "textcraft": [0, 1, 2],
    "sciworld": [0, 1396],
    "textworld": [0, 1],
    "deepsearch": [0, 1, 2],
    "keyword": [0, 1],
}


def _session(tmp_path, model_cache, envs, run):
    cfg = parse_config({
        "seed": 0, "model": {"name_or_path": "tiny", "dtype": "float32", "cache_dir": model_cache},
        "envs": envs,
        "rollout": {"tasks_per_iteration": 2, "group_size": 2, "max_new_tokens": 12,
                    "response_prefix": "Action:", "max_context_tokens": 4096},
        "algorithm": {"skip_tied_groups": False},
        "trainer": {"learning_rate": 1e-3, "bf16": False},
        "schedule": {"stages": [{"horizon": 2, "iterations": 1}]},
        "store": {"root": str(tmp_path / "store")},
    })
    return PolicySession(cfg, run)


def _iterate(session) -> dict:
    ref = IterationRef(0, 0, 0)
    before = {k: v.clone() for k, v in session.engine.model.state_dict().items()}
    out = {**session.collect(ref, horizon=2), **session.advantages(ref), **session.update(ref)}
    out["changed"] = any(not torch.equal(before[k], v) for k, v in session.engine.model.state_dict().items())
    return out


@pytest.mark.parametrize("env", sorted(ENVS))
def test_each_environment_by_one_config_line(tmp_path, model_cache, env):
    out = _iterate(_session(tmp_path, model_cache, [{"name": env, "tasks": ENVS[env]}], f"matrix-{env}"))
    assert out["episodes"] == 4 and out["infra_error_episodes"] == 0
    assert out["turns_per_episode"] >= 1 and out["updated"]


def test_mixed_environment_batch_trains(tmp_path, model_cache):
    envs = [{"name": "babyai", "tasks": [0, 1]}, {"name": "textcraft", "tasks": [0, 1]},
            {"name": "keyword", "tasks": [0], "kwargs": {"target": "aeiou", "mode": "char_share"}}]
    session = _session(tmp_path, model_cache, envs, "matrix-mixed")
    session.cfg = session.cfg.model_copy(update={"rollout": session.cfg.rollout.model_copy(
        update={"tasks_per_iteration": 6})})
    out = _iterate(session)
    eps = session.store.read_table("episodes")
    assert set(eps["env"]) == {"babyai", "textcraft", "keyword"}
    assert out["updated"] and out["changed"]
