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


def _staged(stage_tasks, envs=None):
    envs = envs or [{"name": "babyai", "tasks": list(range(20)), "eval_tasks": [80, 81]},
                    {"name": "textcraft", "tasks": [0, 1, 2], "weight": 1}]
    return parse_config({"envs": envs, "rollout": {"tasks_per_iteration": 4, "group_size": 1},
                         "algorithm": {"estimator": "reinforce_pp"},
                         "schedule": {"stages": [{"horizon": 2, "iterations": 3, "tasks": stage_tasks},
                                                 {"horizon": 4, "iterations": 3}]}})


def test_stage_tasks_restrict_training_draws_of_their_stage_only():
    cfg = _staged({"babyai": [3, 4]})
    for step in range(3):  # stage 0: babyai from its subset, textcraft (not named) from all its tasks
        specs = plan_episodes(cfg, step)
        assert {s.task_id for s in specs if s.env == "babyai"} == {3, 4}
        assert {s.task_id for s in specs if s.env == "textcraft"} <= {0, 1, 2}
    later = {s.task_id for step in range(3, 6) for s in plan_episodes(cfg, step) if s.env == "babyai"}
    assert not later <= {3, 4}  # stage 1 draws from all 20 again
    assert {s.task_id for s in plan_episodes(cfg, 0, eval_split=True)} == {80, 81}  # held-out unchanged
    assert [s.model_dump() for s in cfg.stages][0]["tasks"] == {"babyai": [3, 4]}


def test_stage_tasks_are_checked_against_the_environments():
    import pytest

    with pytest.raises(ValueError, match=r"schedule.stages\[0\].tasks.sciworld: no environment named"):
        _staged({"sciworld": [0]})
    with pytest.raises(ValueError, match=r"tasks \[30\] that are not in that environment's envs\[\].tasks"):
        _staged({"babyai": [3, 30]})
    with pytest.raises(ValueError, match="is empty"):
        _staged({"babyai": []})


def test_a_stage_subset_of_every_task_plans_what_no_subset_plans():
    """Naming all of an environment's tasks draws exactly what naming none draws (same pools, same
    random calls), so configs without stage tasks plan as they did before the option existed."""
    envs = [{"name": "babyai", "tasks": list(range(20))}, {"name": "textcraft", "tasks": [0, 1, 2]}]
    everything = _staged({"babyai": list(range(20)), "textcraft": [0, 1, 2]}, envs)
    nothing = _staged(None, envs)
    for step in range(6):
        for draw in (0, 1):
            assert plan_episodes(everything, step, draw=draw) == plan_episodes(nothing, step, draw=draw)
