"""Every shipped environment config of Table 1 (and the quickstart) holds out >= 32 tasks per
environment, none of them a training task (docs/results.md, "Table 1 at our scale")."""

import sys
from pathlib import Path

import pytest

from agentgym.config import load_config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "learning"))
import table1  # noqa: E402

CONFIGS = sorted(set(table1.COLUMNS.values()) | {"configs/quickstart.yaml"})


@pytest.mark.parametrize("path", CONFIGS)
def test_at_least_32_held_out_tasks_per_environment_disjoint_from_training(path):
    cfg = load_config(ROOT / path)
    for env in cfg.envs:
        held = set(env.eval_tasks)
        assert len(held) == len(env.eval_tasks), f"{path}: {env.name} repeats an eval task"
        assert len(held) >= 32, f"{path}: {env.name} holds out {len(held)} tasks"
        assert not held & set(env.tasks), f"{path}: {env.name} trains on held-out tasks {sorted(held & set(env.tasks))}"


def test_sciworlds_held_out_tasks_are_in_its_test_fold():
    """ScienceWorld's test fold is the last quarter of each task type's variations
    (``ScienceWorldEnv.get_variations_test``, scienceworld 1.2.3); the held-out tasks sit there."""
    from env_adapters.sciworld import TASKS, task_for

    count = {name: n for _, name, n in TASKS}
    for idx in load_config(ROOT / "configs/sciworld.yaml").envs[0].eval_tasks:
        _, name, variation = task_for(idx)
        assert variation >= count[name] - count[name] // 4, (idx, name, variation)
