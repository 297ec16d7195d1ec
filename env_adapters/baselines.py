"""Reference policies that need no model: the floor every learned success rate is shown beside.

``random_valid_action_success`` plays each task with a policy that picks uniformly among
``env.valid_actions()`` every turn (wrapped in a ReAct reply, so it goes through the same parser as
a model). On BabyAI the list is AgentGym's action table (compound ``go to`` / ``pickup`` walk to the
object by themselves, so this floor is far from zero); on TextCraft it is the adapter's list of
plausible commands for the goal's recipe tree (see ``env_adapters.textcraft``).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

from env_adapters import make_env


def random_valid_action_success(
    env_name: str,
    task_ids: Iterable[int],
    horizon: int,
    seed: int = 0,
    env_seed: int = 0,
    **env_kwargs: Any,
) -> dict[str, Any]:
    """Success rate of the uniform random valid-action policy over ``task_ids``.

    Returns ``{"success_rate", "successes", "episodes", "per_task": {task_id: bool},
    "per_task_reward": {task_id: float}, "mean_turns"}``. ``seed`` drives the policy's choices;
    ``env_seed`` is passed to ``reset``. A task's reward is the episode's, booked as the rollout
    does (``agentgym.rollout.loop.record_step``): the last value of a running score
    (``info["reward_is_cumulative"]``, e.g. SciWorld's score / 100), else the sum of the step
    rewards, clipped to [0, 1].
    """
    rng = random.Random(seed)
    per_task: dict[int, bool] = {}
    per_task_reward: dict[int, float] = {}
    turns = 0
    env = make_env(env_name, **env_kwargs)
    try:
        for task_id in task_ids:
            env.reset(task_id, seed=env_seed)
            success = False
            reward = 0.0
            for _ in range(horizon):
                actions = env.valid_actions()
                if not actions:
                    raise ValueError(f"{env_name} does not list valid actions")
                action = rng.choice(actions)
                result = env.step(f"Thought:\nI will try this.\n\nAction:\n{action}")
                turns += 1
                total = float(result.reward) if result.info.get("reward_is_cumulative") \
                    else reward + float(result.reward)
                reward = min(1.0, max(0.0, total))
                if result.info.get("success"):
                    success = True
                if result.terminated:
                    break
            per_task[task_id] = success
            per_task_reward[task_id] = reward
    finally:
        env.close()
    n = len(per_task)
    wins = sum(per_task.values())
    return {
        "success_rate": wins / n if n else 0.0,
        "successes": wins,
        "episodes": n,
        "per_task": per_task,
        "per_task_reward": per_task_reward,
        "mean_turns": turns / n if n else 0.0,
    }
