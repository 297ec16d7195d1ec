from collections import Counter

from agentgym.config import parse_config
from agentgym.pipeline import plan_episodes


def _cfg(envs, n=6, g=3):
    return parse_config({"envs": envs, "rollout": {"tasks_per_iteration": n, "group_size": g},
                         "algorithm": {"estimator": "reinforce_pp"}})


def test_plan_is_a_pure_function_of_step():
    cfg = _cfg([{"name": "babyai", "tasks": list(range(20))}])
    assert plan_episodes(cfg, 4) == plan_episodes(cfg, 4)
    assert plan_episodes(cfg, 4) != plan_episodes(cfg, 5)


def test_groups_share_task_and_seed():
    specs = plan_episodes(_cfg([{"name": "babyai", "tasks": list(range(20))}]), 0)
    groups = {}
    for s in specs:
        groups.setdefault(s.group_id, set()).add((s.env, s.task_id, s.seed))
    assert len(groups) == 6 and all(len(v) == 1 for v in groups.values())
    assert Counter(s.group_id for s in specs) == {g: 3 for g in groups}
    assert len({s.episode_id for s in specs}) == len(specs)
    assert len({s.task_id for s in specs}) == 6  # without replacement while the pool allows


def test_mixed_weights_give_proportional_shares():
    envs = [{"name": "babyai", "tasks": [0, 1, 2, 3], "weight": 2},
            {"name": "textcraft", "tasks": [0, 1], "weight": 1}]
    for step in range(5):
        specs = plan_episodes(_cfg(envs, n=6, g=1), step)
        assert Counter(s.env for s in specs) == {"babyai": 4, "textcraft": 2}


def test_small_pool_repeats_tasks_in_distinct_groups():
    specs = plan_episodes(_cfg([{"name": "keyword", "tasks": [7]}], n=3, g=2), 0)
    assert {s.task_id for s in specs} == {7} and len({s.group_id for s in specs}) == 3


def test_eval_split_uses_eval_tasks():
    cfg = _cfg([{"name": "babyai", "tasks": [0, 1], "eval_tasks": [80, 81]}], n=2, g=1)
    assert {s.task_id for s in plan_episodes(cfg, 0, eval_split=True)} == {80, 81}
