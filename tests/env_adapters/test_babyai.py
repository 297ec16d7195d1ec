"""BabyAI adapter: AgentGym's level mapping, rendering, action table, parsing and reward."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from env_adapters import make_env  # noqa: E402
from env_adapters.babyai import (  # noqa: E402
    ASSISTANT_ACK, LEVELS, SEED_STRIDE, SYSTEM_PROMPT, BabyAIEnv, level_for, parse_reply)
from env_adapters.baselines import random_valid_action_success  # noqa: E402

# AgentGym's all_levels, copied independently of the adapter (agentenv_babyai/environment.py)
AGENTGYM_LEVELS = (
    "GoToRedBallGrey GoToRedBall GoToRedBallNoDists GoToObjS6 GoToLocalS8N7 GoToObjMazeS7 "
    "GoToImpUnlock GoToSeqS5R2 GoToRedBlueBall GoToDoor GoToObjDoor Open OpenRedDoor OpenDoorLoc "
    "OpenRedBlueDoorsDebug OpenDoorsOrderN4Debug Pickup UnblockPickup PickupLoc PickupDistDebug "
    "PickupAbove PutNextLocalS6N4 PutNextS7N4Carrying Unlock UnlockLocalDist KeyInBox "
    "UnlockPickupDist BlockedUnlockPickup UnlockToUnlock ActionObjDoor FindObjS7 KeyCorridorS6R3 "
    "OneRoomS20 MoveTwoAcrossS8N9 SynthS5R2 SynthLoc SynthSeq MiniBossLevel BossLevel "
    "BossLevelNoUnlock"
).split()

# reset(1) -- BabyAI-GoToRedBall-v0, minigrid seed 0 -- as AgentGym's server renders it
SNAPSHOT_TASK1 = (
    "Your goal: go to the red ball\n"
    "In front of you in this room, you can see several objects: "
    "There is a yellow key 1 1 steps in front of you and 1 steps to your left.  "
    "There is a grey ball 1 1 steps in front of you and 1 steps to your right.  "
    "There is a purple key 1 2 steps in front of you and 1 steps to your left.  "
    "There is a blue key 1 2 steps in front of you and 1 steps to your right.  "
    "There is a red box 1 2 steps in front of you and 2 steps to your right.  "
    "There is a grey ball 2 5 steps in front of you and 1 steps to your right.  "
    "There is a green key 1 4 steps in front of you and 2 steps to your right.  "
    "There is a red ball 1 4 steps in front of you and 3 steps to your right.  "
    "The room has walls around you. You are facing a wall 6 steps away. "
    "You are not carrying anything.\n"
    'Available actions: ["turn left", "turn right", "move forward", "pickup yellow key 1", '
    '"pickup grey ball 1", "pickup purple key 1", "pickup blue key 1", "pickup red box 1", '
    '"pickup grey ball 2", "pickup green key 1", "pickup red ball 1", "go to yellow key 1", '
    '"go to grey ball 1", "go to purple key 1", "go to blue key 1", "go to red box 1", '
    '"go to grey ball 2", "go to green key 1", "go to red ball 1", "check available actions"]'
)
SNAPSHOT_TASK1_SOLVED = (
    "In front of you in this room, you can see several objects: "
    "There is a red ball 1 right in front of you 1 steps away.  "
    "There is a green key 1 1 steps in front of you and 1 steps to your left.  "
    "There is a grey ball 1 2 steps in front of you and 2 steps to your left.  "
    "The room has walls around you. You are facing a wall 3 steps away. "
    "You are not carrying anything.\n The task is completed.\n"
    'Available actions: ["turn left", "turn right", "move forward", "pickup red ball 1", '
    '"pickup green key 1", "pickup grey ball 1", "go to red ball 1", "go to green key 1", '
    '"go to grey ball 1", "check available actions"]'
)


@pytest.fixture(scope="module")
def env():
    e = BabyAIEnv()
    yield e
    e.close()


def test_registered_and_levels_match_agentgym():
    assert make_env("babyai").name == "babyai"
    assert len(LEVELS) == 40
    for i, short in enumerate(AGENTGYM_LEVELS, start=1):
        version = "v1" if short == "GoToObjS6" else "v0"  # minigrid 3 only registers GoToObjS6-v1
        assert LEVELS[i] == f"BabyAI-{short}-{version}"


def test_task_mapping_0_to_79(env):
    for data_idx in range(80):
        level, seed = level_for(data_idx)
        assert (level, seed) == (LEVELS[data_idx % 40 + 1], data_idx // 40)
        obs, info = env.reset(data_idx)
        assert info["level"] == level and info["minigrid_seed"] == seed
        assert obs.startswith("Your goal: ") and "\nAvailable actions: [" in obs
    # seed offsets the AgentGym seed without colliding with another task's seed
    _, info = env.reset(41, seed=3)
    assert info["minigrid_seed"] == 1 + 3 * SEED_STRIDE


def test_rendering_snapshot(env):
    obs, info = env.reset(1)
    assert obs == SNAPSHOT_TASK1
    assert info["mission"] == "go to the red ball" and info["success"] is False
    assert env.valid_actions()[-1] == "check available actions"
    r = env.step("Thought:\nThe red ball is ahead on my right.\n\nAction:\ngo to red ball 1")
    assert r.observation == SNAPSHOT_TASK1_SOLVED
    assert r.terminated and not r.truncated and r.info["success"] is True
    # AgentGym's reward: minigrid's 1 - 0.9 * step_count / max_steps for the compound action
    assert r.reward == pytest.approx(0.8875)
    assert r.info["parsed_action"] == "go to red ball 1"


def test_mission_rewrite_then_and_after_you(env):
    for data_idx in range(40):
        _, info = env.reset(data_idx)
        assert " then " not in info["mission"] and "after you" not in info["mission"]


@pytest.mark.parametrize("task_id", [0, 1, 2, 3, 40, 41, 42, 43, 80, 81, 82])
def test_gold_goto_policy_reaches_reward(env, task_id):
    """Scripted policy: issue `go to <mission object>` when listed, else turn left."""
    _, info = env.reset(task_id)
    m = re.match(r"go to (?:the|a) (\w+) (\w+)$", info["mission"])
    assert m, info["mission"]
    for _ in range(8):
        wanted = [a for a in env.valid_actions() if a.startswith(f"go to {m[1]} {m[2]} ")]
        r = env.step("Thought:\nI go.\n\nAction:\n" + (wanted[0] if wanted else "turn left"))
        if r.terminated:
            break
    assert r.terminated and r.info["success"]
    assert 0.5 < r.reward <= 1.0


def test_invalid_actions_are_agentgym_messages(env):
    env.reset(1)
    before = env.valid_actions()
    r = env.step("Action: fly to the moon")
    assert r.observation.startswith(
        "The action is not recognized. Please check valid actions.\nAvailable actions: [")
    assert r.info["invalid_action"] is True and r.info["format_error"] is False
    assert r.reward == 0.0 and not r.terminated
    r = env.step("Action: drop")
    assert r.observation.startswith(
        "You cannot drop the object, as you are not carrying anything.\n")
    assert r.info["invalid_action"] is True
    r = env.step("Action: check available actions")
    assert r.observation.startswith("You can take the following actions: turn left, turn right")
    assert r.info["invalid_action"] is False
    assert env.valid_actions() == before  # nothing moved


def test_lenient_parsing(env):
    assert parse_reply("Thought: x\nAction: Turn Left.") == ("turn left", "")
    assert parse_reply("**Action:** `go to red ball 1`") == ("go to red ball 1", "")
    assert parse_reply("Action: turn left\nAction:\n  Move   Forward  \n") == ("move forward", "")
    assert parse_reply("action : turn right</s>") == ("turn right", "")
    assert parse_reply("turn right") == ("turn right", "")  # AgentGym sends a bare reply as is
    assert parse_reply("I think\nI should turn")[0] is None
    for junk in ["", "   ", "\x00\x01", "Action:", "Action:  \n ", "x" * 2001]:
        assert parse_reply(junk)[0] is None, junk
    env.reset(1)
    r = env.step("Thought: pick it.\nAction: Pick up red ball 1.")  # the prompt's spelling
    assert r.info["parsed_action"] == "pickup red ball 1" and not r.info["invalid_action"]
    assert "You are carrying a red ball." in r.observation


def test_format_errors_consume_the_turn(env):
    env.reset(1)
    for junk in ["", "\x00\x01", "x" * 5000, "Action:"]:
        r = env.step(junk)
        assert r.info["format_error"] is True and r.reward == 0.0 and not r.terminated
        assert r.observation.startswith("Invalid format")
        assert "Available actions: [" in r.observation
    assert env.step("Action: go to red ball 1").terminated  # the episode is still playable


def test_prompt_is_agentgym(env):
    assert env.system_prompt() == SYSTEM_PROMPT
    assert SYSTEM_PROMPT.startswith("You are an exploration master")
    assert SYSTEM_PROMPT.endswith("Thought:\n<Your Thought>\n\nAction:\n<Your Action>")
    assert ASSISTANT_ACK.startswith("OK.")


def test_seed_changes_layout_deterministically():
    a, b = BabyAIEnv(), BabyAIEnv()
    try:
        assert a.reset(16, seed=5)[0] == b.reset(16, seed=5)[0]
        assert a.reset(16, seed=0)[0] != a.reset(16, seed=5)[0]
    finally:
        a.close()
        b.close()


def test_random_valid_action_baseline():
    res = random_valid_action_success("babyai", range(40), horizon=10, seed=0)
    print(f"\nBabyAI random-valid-action success, tasks 0..39, horizon 10: "
          f"{res['successes']}/{res['episodes']} = {res['success_rate']:.0%}")
    assert res["episodes"] == 40
    assert 0.05 <= res["success_rate"] <= 0.6
    # the GoTo levels (tasks 1..4) are the easy ones for this floor
    assert sum(res["per_task"][t] for t in range(1, 5)) >= 2


# ---------------------------------------------------------------- doors: go through / toggle

OPEN_RED_DOOR = 12  # BabyAI-OpenRedDoor-v0, minigrid seed 0: one closed red door in view


def _pos(e: BabyAIEnv) -> tuple[int, int]:
    u = e._env.unwrapped
    return int(u.agent_pos[0]), int(u.agent_pos[1])


def _doors(e: BabyAIEnv) -> dict[tuple[int, int], object]:
    grid = e._env.unwrapped.grid
    return {(i, j): c for i in range(grid.width) for j in range(grid.height)
            if (c := grid.get(i, j)) is not None and c.type == "door"}


def _room(e: BabyAIEnv, pos: tuple[int, int]) -> tuple[int, int]:
    return tuple(e._env.unwrapped.room_from_pos(*pos).top)


def test_toggle_and_go_through_opens_the_door_and_steps_into_it(env):
    """AgentGym's ``toggle and go through <door> <n>``: the path to face the door, toggle, one
    step forward -- the agent ends standing in the (now open) doorway; one more step and it is
    in the next room."""
    obs, info = env.reset(OPEN_RED_DOOR)
    assert info["level"] == "BabyAI-OpenRedDoor-v0"
    start = _pos(env)
    closed = {p for p, d in _doors(env).items() if not d.is_open}
    assert "There is a red closed door 1 " in obs
    action = "toggle and go through red closed door 1"
    assert action in env.valid_actions()
    assert env.action_space[action][-2:] == [5, 2]  # ... toggle, forward
    # AgentGym refuses a plain "go through" on a closed door, and nothing moves
    r = env.step("Action: go through red closed door 1")
    assert r.observation.startswith("You cannot go through red closed door 1, as it is closed. "
                                    "You should toggle it first.\n")
    assert r.info["invalid_action"] is True and _pos(env) == start

    r = env.step(f"Thought:\nOpen it and walk in.\n\nAction:\n{action}")
    assert r.info["parsed_action"] == action and r.info["invalid_action"] is False
    doorway = _pos(env)
    assert doorway != start and doorway in closed  # standing on the door's cell
    assert _doors(env)[doorway].is_open and _doors(env)[doorway].color == "red"
    # AgentGym quirk, kept: the step after the toggle is verified too, and minigrid only
    # credits "open the door" on the toggle itself, so the compound action does not succeed
    assert not r.terminated and r.reward == 0.0
    assert "red closed door" not in r.observation  # the door is underfoot, no longer in view
    r = env.step("Action: move forward")
    assert _room(env, _pos(env)) != _room(env, start)  # through: the other room


def test_go_through_an_open_door_walks_onto_it():
    """``go through <open door> <n>``: a path that *arrives* on the door's cell (AgentGym's
    ``find_path(..., arrive=True)``), here two steps back through the door opened before."""
    e = BabyAIEnv()
    try:
        e.reset(OPEN_RED_DOOR)
        start = _pos(e)
        e.step("Action: toggle and go through red closed door 1")
        doorway = _pos(e)
        for a in ("move forward", "move forward", "turn left", "turn left"):
            r = e.step("Action: " + a)
            assert r.info["parsed_action"] == a and not r.info["invalid_action"]
        beyond = _pos(e)
        assert _room(e, beyond) != _room(e, start)
        assert abs(beyond[0] - doorway[0]) + abs(beyond[1] - doorway[1]) == 2
        assert "There is a red open door 1 right in front of you 2 steps away." in r.observation
        action = "go through red open door 1"
        assert action in e.valid_actions() and e.action_space[action] == [2, 2]
        assert not any(a.startswith("toggle") for a in e.valid_actions())
        r = e.step(f"Thought:\nBack through the door.\n\nAction:\n{action}")
        assert r.info["parsed_action"] == action and r.info["invalid_action"] is False
        assert _pos(e) == doorway and _doors(e)[doorway].is_open
        e.step("Action: move forward")
        assert _room(e, _pos(e)) == _room(e, start)  # back in the first room
    finally:
        e.close()


def test_locked_door_needs_a_key():
    """A locked door is listed but ``toggle and go through`` is refused without its key."""
    e = BabyAIEnv()
    try:
        obs, info = e.reset(9)  # BabyAI-GoToDoor-v0: a grey locked door in view, no key carried
        assert "grey locked door 1" in obs and "You are not carrying anything." in obs
        start = _pos(e)
        action = "toggle and go through grey locked door 1"
        assert action not in e.valid_actions()
        r = e.step("Action: " + action)
        assert r.observation.startswith(
            "You cannot toggle and go through grey locked door 1, as you are not carrying a key.")
        assert r.info["invalid_action"] is True and _pos(e) == start
    finally:
        e.close()


# ---------------------------------------------------------------- observation_style="compact"
SNAPSHOT_TASK1_COMPACT = (
    "Goal: go to the red ball\n"
    "You see: yellow key 1 (1 ahead, 1 left), grey ball 1 (1 ahead, 1 right), purple key 1 "
    "(2 ahead, 1 left), blue key 1 (2 ahead, 1 right), red box 1 (2 ahead, 2 right), grey ball 2 "
    "(5 ahead, 1 right), green key 1 (4 ahead, 2 right), red ball 1 (4 ahead, 3 right). "
    "Facing a wall 6 steps away. Carrying nothing.\n"
    "Actions: turn left, turn right, move forward, check available actions; pickup or go to: "
    "yellow key 1, grey ball 1, purple key 1, blue key 1, red box 1, grey ball 2, green key 1, "
    "red ball 1"
)


def _agentgym_facts(obs: str) -> tuple[list[tuple[str, int, int]], set[str]]:
    """(objects with front/right offsets, listed actions) parsed from AgentGym's text."""
    objs = [(m[0], int(m[1]), int(m[3]) * (1 if m[4] == "right" else -1) if m[3] else 0)
            for m in re.findall(r"There is a ([a-z ]+ \d+) (?:right in front of you )?(\d+) steps "
                                r"(away|in front of you and (\d+) steps to your (left|right))",
                                obs)]
    actions = set(re.search(r'Available actions: \[(.*)\]', obs)[1].strip('"').split('", "'))
    return objs, actions


def _compact_facts(obs: str) -> tuple[list[tuple[str, int, int]], set[str]]:
    """The same facts parsed from the compact text (a second, independent reading)."""
    seen = re.search(r"You see: (.*?)\. (?:Facing|Carrying)", obs)
    objs = []
    for m in re.findall(r"([a-z ]+ \d+) \((\d+) ahead(?:, (\d+) (left|right))?\)",
                        seen[1] if seen else ""):
        objs.append((m[0].strip(), int(m[1]), int(m[2]) * (1 if m[3] == "right" else -1)
                     if m[2] else 0))
    actions: set[str] = set()
    for part in obs.split("\nActions: ")[1].split("; "):
        if ": " not in part:
            actions |= set(part.split(", "))
            continue
        verbs, objects = part.split(": ")
        actions |= {f"{v} {o}" for v in verbs.split(" or ") for o in objects.split(", ")}
    return objs, actions


def test_compact_rendering_snapshot():
    env = BabyAIEnv(observation_style="compact")
    obs, _ = env.reset(1)
    assert obs == SNAPSHOT_TASK1_COMPACT
    r = env.step("Action: go to red ball 1")
    assert r.terminated and r.reward == pytest.approx(0.8875)  # same dynamics as AgentGym's
    env.close()


@pytest.mark.parametrize("task_id", [1, 3, 9, 10, 11, 16, 23, 27, 41])
def test_compact_says_what_agentgym_says_with_fewer_tokens(task_id):
    """Two envs stepped alike: the compact text names the same objects at the same offsets and
    exactly the same valid actions (doors, pickups, drop, toggle), and is shorter."""
    import random

    full, compact = BabyAIEnv(), BabyAIEnv(observation_style="compact")
    rng = random.Random(task_id)
    o_full, _ = full.reset(task_id)
    o_comp, _ = compact.reset(task_id)
    for _ in range(8):
        assert _compact_facts(o_comp) == _agentgym_facts(o_full)
        assert _compact_facts(o_comp)[1] == set(compact.valid_actions()) == set(full.valid_actions())
        assert len(o_comp) < len(o_full)
        action = rng.choice(full.valid_actions())
        r_full, r_comp = full.step(action), compact.step(action)
        assert (r_full.reward, r_full.terminated) == (r_comp.reward, r_comp.terminated)
        if r_full.terminated:
            break
        o_full, o_comp = r_full.observation, r_comp.observation
    full.close()
    compact.close()


def test_unknown_observation_style_names_the_field():
    with pytest.raises(ValueError, match="observation_style"):
        BabyAIEnv(observation_style="terse")


def test_state_key_is_the_grid_the_pose_and_what_is_carried(env):
    """GiGPO's step groups need equal states to have equal keys however they were reached, and
    different states different keys: turning back is the same state; moving, turning or picking
    something up is another."""
    _, info = env.reset(16)
    start = info["state_key"]
    left = env.step("Action: turn left").info["state_key"]
    assert left != start
    assert env.step("Action: turn right").info["state_key"] == start
    bad = env.step("Action: fly away")  # an invalid action changes nothing
    assert bad.info["invalid_action"] and bad.info["state_key"] == start
    pick = next(a for a in env.valid_actions() if a.startswith("pickup "))
    carried = env.step(f"Action: {pick}").info["state_key"]
    assert carried != start and carried.endswith(pick.removeprefix("pickup ").removesuffix(" 1"))
    assert env.reset(16)[1]["state_key"] == start  # a reset reproduces it
    assert env.reset(17)[1]["state_key"] != start
