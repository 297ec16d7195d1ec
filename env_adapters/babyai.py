"""BabyAI as AgentGym serves it, in-process over ``minigrid`` 3.x.

A faithful re-implementation of ``agentenv-babyai`` (``agentenv_babyai/environment.py`` and its
server, WooooDyy/AgentGym), with the AgentGym client's ReAct parsing in front of it:

* **Tasks.** ``data_idx`` picks level ``data_idx % 40 + 1`` of AgentGym's 40-level table and the
  minigrid seed ``data_idx // 40`` (``reset(task_id, seed=0)`` is exactly AgentGym's mapping;
  ``seed=s`` adds ``s * SEED_STRIDE`` so that no (task, seed) pair collides with another task's
  seed). ``BabyAI-GoToObjS6-v0`` is registered as ``-v1`` in minigrid 3.
* **Text.** The agent's 7x7 egocentric view is rendered the AgentGym way: every visible door, key,
  ball, box, goal, lava (numbered per name, nearest first) with its offset in front/left/right,
  the distance to the wall or box straight ahead, and what the agent carries, followed by
  ``Available actions: ["turn left", ...]``. The first observation starts with ``Your goal: ...``
  (the mission, with "then" / "after you" rewritten to "and", as AgentGym does).
* **Actions.** ``turn left``, ``turn right``, ``move forward``, ``drop``, ``toggle``, and the
  compound ``go to <obj> <n>``, ``pickup <obj> <n>``, ``go through <open door> <n>``,
  ``toggle and go through <door> <n>``, ``go to goal`` -- expanded into primitive minigrid actions
  by AgentGym's breadth-first search over the visible cells (quirks included), executed one by
  one until one of them leaves the view unchanged -- plus ``check available actions``.
* **Reward.** AgentGym's rule: the reward of a step is minigrid's reward of the last primitive
  action (``1 - 0.9 * step_count / max_steps`` when the mission is accomplished, else 0); the
  episode terminates (``info["success"]``) only when the mission is done with a reward > 0.5.

Differences from AgentGym, all deliberate: the reply is parsed leniently (text after the *last*
``Action:``, first non-empty line, case / punctuation / whitespace normalised, ``pick up`` accepted
for ``pickup``); an unparseable, empty or over-long reply is a format error (AgentGym would send it
to the server as an action); an invalid, ``check`` or no-op action earns reward 0 instead of
repeating the previous step's reward; stepping a finished episode returns a terminal observation
instead of the server's error. The path search and rendering are otherwise line-for-line.
"""

from __future__ import annotations

import hashlib

import re
from collections import deque
from typing import Any

import numpy as np

from agentgym.patches.minigrid import silence_rejected_samples
from env_adapters.base import StateKeyedEnv, StepResult, format_error
from env_adapters.parsing import parse_action

#: AgentGym's ``all_levels`` (agentenv_babyai/environment.py), 1-based.
LEVELS: dict[int, str] = {
    1: "BabyAI-GoToRedBallGrey-v0",
    2: "BabyAI-GoToRedBall-v0",
    3: "BabyAI-GoToRedBallNoDists-v0",
    4: "BabyAI-GoToObjS6-v1",  # -v0 in AgentGym; minigrid 3 registers only -v1
    5: "BabyAI-GoToLocalS8N7-v0",
    6: "BabyAI-GoToObjMazeS7-v0",
    7: "BabyAI-GoToImpUnlock-v0",
    8: "BabyAI-GoToSeqS5R2-v0",
    9: "BabyAI-GoToRedBlueBall-v0",
    10: "BabyAI-GoToDoor-v0",
    11: "BabyAI-GoToObjDoor-v0",
    12: "BabyAI-Open-v0",
    13: "BabyAI-OpenRedDoor-v0",
    14: "BabyAI-OpenDoorLoc-v0",
    15: "BabyAI-OpenRedBlueDoorsDebug-v0",
    16: "BabyAI-OpenDoorsOrderN4Debug-v0",
    17: "BabyAI-Pickup-v0",
    18: "BabyAI-UnblockPickup-v0",
    19: "BabyAI-PickupLoc-v0",
    20: "BabyAI-PickupDistDebug-v0",
    21: "BabyAI-PickupAbove-v0",
    22: "BabyAI-PutNextLocalS6N4-v0",
    23: "BabyAI-PutNextS7N4Carrying-v0",
    24: "BabyAI-Unlock-v0",
    25: "BabyAI-UnlockLocalDist-v0",
    26: "BabyAI-KeyInBox-v0",
    27: "BabyAI-UnlockPickupDist-v0",
    28: "BabyAI-BlockedUnlockPickup-v0",
    29: "BabyAI-UnlockToUnlock-v0",
    30: "BabyAI-ActionObjDoor-v0",
    31: "BabyAI-FindObjS7-v0",
    32: "BabyAI-KeyCorridorS6R3-v0",
    33: "BabyAI-OneRoomS20-v0",
    34: "BabyAI-MoveTwoAcrossS8N9-v0",
    35: "BabyAI-SynthS5R2-v0",
    36: "BabyAI-SynthLoc-v0",
    37: "BabyAI-SynthSeq-v0",
    38: "BabyAI-MiniBossLevel-v0",
    39: "BabyAI-BossLevel-v0",
    40: "BabyAI-BossLevelNoUnlock-v0",
}
NUM_LEVELS = len(LEVELS)

#: minigrid module of each BabyAI level class -> category name (AgentGym-RL's level families).
BABYAI_FAMILIES: dict[str, str] = {
    "goto": "GoTo", "open": "Open", "pickup": "Pickup", "putnext": "PutNext",
    "unlock": "Unlock", "synth": "Synth", "other": "Other",
}
#: AgentGym level number (``data_idx % 40 + 1``) -> family. Levels 1-11 GoTo, 12-16 Open,
#: 17-21 Pickup, 22-23 PutNext, 24-29 Unlock, 30-34 Other, 35-40 Synth/Boss.
BABYAI_LEVEL_FAMILY: dict[int, str] = {
    **{i: "GoTo" for i in range(1, 12)},
    **{i: "Open" for i in range(12, 17)},
    **{i: "Pickup" for i in range(17, 22)},
    **{i: "PutNext" for i in range(22, 24)},
    **{i: "Unlock" for i in range(24, 30)},
    **{i: "Other" for i in range(30, 35)},
    **{i: "Synth" for i in range(35, 41)},
}

#: ``reset(task, seed=s)`` uses minigrid seed ``task // 40 + s * SEED_STRIDE``.
SEED_STRIDE = 1_000_000

MAX_REPLY_CHARS = 2000

#: The human turn of AgentGym's ``BabyAIEnvClient.conversation_start`` (agentenv/envs/babyai.py).
SYSTEM_PROMPT = (
    "You are an exploration master that wants to finish every goal you are given. Every round I "
    "will give you an observation, and you have to respond an action and your thought based on "
    "the observation to finish the given task. You are placed in a room and you need to "
    "accomplish the given goal with actions.\n\nYou can use the following actions: \n\n"
    "- turn right \n\n- turn left \n\n- move forward \n\n- go to <obj> <id> \n\n"
    "- pick up <obj> <id> \n\n- go through <door> <id>: <door> must be an open door. \n\n"
    "- toggle and go through <door> <id>: <door> can be a closed door or a locked door. If you "
    "want to open a locked door, you need to carry a key that is of the same color as the locked "
    "door. \n\n- toggle: there is a closed or locked door right in front of you and you can "
    "toggle it.\nYour response should use the following format:\nThought:\n<Your Thought>\n\n"
    "Action:\n<Your Action>"
)
#: The scripted assistant turn that follows it in AgentGym's conversation start.
ASSISTANT_ACK = "OK. I'll follow your instructions and try my best to solve the task."

IDX_TO_OBJECT = {0: "unseen", 1: "empty", 2: "wall", 3: "floor", 4: "door", 5: "key",
                 6: "ball", 7: "box", 8: "goal", 9: "lava", 10: "agent"}
IDX_TO_STATE = {0: "open", 1: "closed", 2: "locked"}
IDX_TO_COLOR = {0: "red", 1: "green", 2: "blue", 3: "purple", 4: "yellow", 5: "grey"}
DIR_TO_VEC = [np.array((1, 0)), np.array((0, 1)), np.array((-1, 0)), np.array((0, -1))]
_DIRS = [(1, 0), (0, 1), (-1, 0), (0, -1)]
_BLOCKING = ("wall", "box", "lava", "ball", "key")  # name substrings the path search avoids


def level_for(data_idx: int) -> tuple[str, int]:
    """AgentGym's task mapping: ``(level name, minigrid seed)`` for ``data_idx``."""
    return LEVELS[data_idx % NUM_LEVELS + 1], data_idx // NUM_LEVELS


def parse_reply(reply: str, max_chars: int = MAX_REPLY_CHARS) -> tuple[str | None, str]:
    """Extract the action from a ReAct reply; returns ``(action, "")`` or ``(None, why)``.

    The text after the last ``Action:`` (any case), first non-empty line; without the marker a
    one-line reply is taken as the action (AgentGym sends the whole reply then): see
    :func:`env_adapters.parsing.parse_action`. Normalised to lower case, ``[a-z0-9 ]`` only
    (drops quotes, markdown, a trailing period), single spaces.
    """
    return parse_action(reply, max_chars, _normalise)


def _normalise(line: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9 ]+", " ", line.lower()).split())


#: ``observation_style`` values: AgentGym's text byte for byte, or the same facts in fewer tokens.
OBSERVATION_STYLES = ("agentgym", "compact")
#: Compound-action verbs the compact style lists once, followed by their objects (longest first:
#: "toggle and go through " is not read as another verb's prefix).
_COMPACT_VERBS = ("toggle and go through ", "go through ", "pickup ", "go to ")


def _actions_suffix(actions: list[str]) -> str:
    """The server's ``\\nAvailable actions: ["a", "b"]`` suffix, byte for byte."""
    s = "\nAvailable actions: ["
    for a in actions:
        s += '"' + a + '", '
    if s[-1] != "[":
        s = s[:-2] + "]"
    return s


def _compact_actions_suffix(actions: list[str]) -> str:
    """The same action list in about half the tokens: plain actions first, then each compound
    verb once with its objects, in the table's order::

        Actions: turn left, turn right, move forward, check available actions; pickup or go to:
        grey box 1, red ball 1; go to: blue door 1
    """
    plain: list[str] = []
    grouped: dict[str, list[str]] = {}
    for a in actions:
        verb = next((v for v in _COMPACT_VERBS if a.startswith(v)), None)
        if verb is None or a == "go to goal":
            plain.append(a)
        else:
            grouped.setdefault(verb.strip(), []).append(a[len(verb):])
    merged: dict[tuple[str, ...], list[str]] = {}  # verbs with the same objects share one list
    for verb, objs in grouped.items():
        merged.setdefault(tuple(objs), []).append(verb)
    parts = [", ".join(plain)] + [f"{' or '.join(verbs)}: {', '.join(objs)}"
                                  for objs, verbs in merged.items()]
    return "\nActions: " + "; ".join(parts)


def _compact_description(seen: list[tuple[str, int, int]], barrier: tuple[str, int] | None,
                         carrying: str | None) -> str:
    """What the AgentGym description says, shorter: ``You see: grey box 1 (1 ahead, 2 left),
    red ball 1 (3 ahead). Facing a wall 6 steps away. Carrying nothing.``"""
    items = []
    for name, front, right in seen:
        side = "" if right == 0 else f", {abs(right)} {'right' if right > 0 else 'left'}"
        items.append(f"{name} ({front} ahead{side})")
    text = ("You see: " + ", ".join(items) + ".") if items else "You see no objects."
    if barrier is not None:
        text += f" Facing a {barrier[0]} {barrier[1]} steps away."
    return text + " Carrying " + (f"a {carrying}." if carrying else "nothing.")


class BabyAIEnv(StateKeyedEnv):
    """One BabyAI episode at a time, rendered and stepped the AgentGym way."""

    name = "babyai"

    @classmethod
    def task_category(cls, task_id: int) -> str:
        """The level family of ``data_idx`` (AgentGym-RL's BabyAI table is per family)."""
        return BABYAI_LEVEL_FAMILY[int(task_id) % NUM_LEVELS + 1]

    def __init__(self, max_reply_chars: int = MAX_REPLY_CHARS,
                 observation_style: str = "agentgym") -> None:
        """``observation_style``: ``"agentgym"`` renders AgentGym's text byte for byte;
        ``"compact"`` says the same things (every visible object with its offset, the barrier
        ahead, what is carried, exactly the valid actions) in about half the tokens -- prefill is
        most of the cost of a CPU rollout, evaluation or SFT step. SmolLM2's tokenizer, a
        six-object view: 292 tokens against 137; random play on 16 GoTo tasks: 145 against 79 a
        turn on average."""
        if observation_style not in OBSERVATION_STYLES:
            raise ValueError(f"observation_style must be one of {OBSERVATION_STYLES}, "
                             f"not {observation_style!r} (envs[].kwargs.observation_style)")
        self.max_reply_chars = max_reply_chars
        self.compact = observation_style == "compact"
        self._envs: dict[str, Any] = {}  # level name -> gymnasium env (reused across resets)
        self._env: Any = None
        self._closed = False
        self._ready = False

    # ------------------------------------------------------------------ TextEnv API
    def system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def valid_actions(self) -> list[str] | None:
        return list(self.action_space) if self._ready else None

    def state_key(self) -> str:
        """The environment state (``info["state_key"]``): a digest of the grid's encoding (objects,
        colours, door states), the agent's position and direction, and what it carries; equal
        keys are the same state whatever the observation text says (GiGPO's step groups)."""
        u = self._env.unwrapped
        grid = hashlib.blake2b(u.grid.encode().tobytes(), digest_size=12).hexdigest()
        carrying = f"{u.carrying.color} {u.carrying.type}" if u.carrying is not None else "-"
        return f"babyai:{grid}:{int(u.agent_pos[0])},{int(u.agent_pos[1])}:{int(u.agent_dir)}:{carrying}"

    def _reset(self, task_id: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
        if task_id < 0 or seed < 0:
            raise ValueError("task_id and seed must be >= 0")
        if self._closed:
            raise RuntimeError("environment is closed")
        level, ag_seed = level_for(int(task_id))
        mg_seed = ag_seed + int(seed) * SEED_STRIDE
        env: Any = self._envs.get(level)  # a gymnasium env wrapping minigrid's (its .unwrapped)
        if env is None:
            import gymnasium
            import minigrid  # noqa: F401  (registers the BabyAI levels)

            # minigrid prints every rejected level sample ("Sampling rejected: ...") to stdout
            silence_rejected_samples()
            env = gymnasium.make(level, disable_env_checker=True)
            self._envs[level] = env
        self._env = env
        obs, _ = env.reset(seed=mg_seed)
        goal = env.unwrapped.mission
        if "then" in goal:
            goal = goal.replace("then", "and")
        if "after you" in goal:
            goal = goal.replace("after you", "and")
        self.goal = goal
        description, self.action_space = self._postprocess_obs(obs)
        self._view = description
        self.obs_2d = obs["image"]
        self.reward = 0.0
        self.done = False
        self.score = 0.0
        self.steps = 0
        self._ready = True
        self.task = {"task_id": int(task_id), "seed": int(seed), "level": level,
                     "minigrid_seed": mg_seed}
        lead = "Goal: " if self.compact else "Your goal: "
        observation = lead + goal + "\n" + description + self._suffix()
        return observation, {**self.task, "mission": goal, "success": False}

    def _step(self, action_text: str) -> StepResult:
        if not self._ready:
            raise RuntimeError("call reset() before step()")
        base = {**self.task, "success": self.done, "invalid_action": False,
                "format_error": False, "parsed_action": None, "score": self.score}
        if self.done:
            return StepResult("The task is completed.", 0.0, True, False, base)
        action, why = parse_reply(action_text, self.max_reply_chars)
        if action is None:
            msg = ("Invalid format: " + why + ". End your reply with a line \"Action: <action>\" "
                   "naming one of the available actions." + self._suffix())
            self.steps += 1
            return format_error(msg, **{**base, "format_error": True})
        if action.startswith("pick up "):  # the AgentGym prompt says "pick up", the env "pickup"
            action = "pickup " + action[len("pick up "):]
        base["parsed_action"] = action
        self.steps += 1
        if "check" in action:
            text = "You can take the following actions: " + ", ".join(self.action_space)
            return StepResult(text + self._suffix(), 0.0, False, False, base)
        if action not in self.action_space:
            text = self.error_message.get(
                action, "The action is not recognized. Please check valid actions.")
            return StepResult(text + self._suffix(), 0.0, False, False,
                              {**base, "invalid_action": True})
        primitives = self.action_space[action]
        if not primitives:
            return StepResult("No change in state." + self._suffix(), 0.0, False, False, base)
        # gymnasium's step values of the last primitive (there is at least one)
        obs: Any = None
        reward: Any = None
        done: Any = None
        for a in primitives:
            obs, reward, done, _trunc, _ = self._env.step(a)
            if not (obs["image"] != self.obs_2d).sum() > 0:
                break  # the primitive changed nothing: stop, as AgentGym's verify_action does
            self.obs_2d = obs["image"]
        description, self.action_space = self._postprocess_obs(obs)
        self._view = description
        self.obs_2d = obs["image"]
        self.reward = float(reward)
        self.done = bool(done)
        if self.done:
            description += "\n The task is completed."
        if self.done and self.reward <= 0.5:  # AgentGym: a late (or failed) finish is not done
            self.done = False
        self.score += self.reward
        info = {**base, "success": self.done, "score": self.score}
        return StepResult(description + self._suffix(), self.reward, self.done, False, info)

    def context_summary(self) -> str | None:
        """The goal and what the agent sees now, in the reset observation's form."""
        if not self._ready:
            return None
        lead = "Goal: " if self.compact else "Your goal: "
        return lead + self.goal + "\n" + self._view + self._suffix()

    def close(self) -> None:
        for env in self._envs.values():
            try:
                env.close()
            except Exception:  # noqa: BLE001 - closing must not raise
                pass
        self._envs.clear()
        self._env = None
        self._ready = False
        self._closed = True

    # ------------------------------------------------------------------ AgentGym internals
    def _suffix(self) -> str:
        if self.compact:
            return _compact_actions_suffix(list(self.action_space))
        return _actions_suffix(list(self.action_space))

    @staticmethod
    def _find_path(init_pos, goal, blocked, init_dir, xrange, yrange, arrive=False):
        """AgentGym's ``find_path``: BFS over (cell, direction) with forward/left/right.

        Kept step for step (queue order, the visited set filled on pop, parents overwritten on
        re-push) so the chosen path is AgentGym's; only the obstacle test is precomputed.
        """
        graph: dict = {}
        queue = deque([(init_pos, init_dir)])
        state: set = set()
        gx, gy = goal
        while queue:
            pos, d = queue.popleft()
            state.add((pos, d))
            dx, dy = _DIRS[d]
            if (arrive and pos == goal) or (not arrive and gx - pos[0] == dx and gy - pos[1] == dy):
                path = []
                while (pos, d) != (init_pos, init_dir):
                    (pos, d), a = graph[(pos, d)]
                    path.append(a)
                return path[::-1]
            for a in (2, 0, 1):
                if a == 0:
                    npos, nd = pos, (d - 1) % 4
                elif a == 1:
                    npos, nd = pos, (d + 1) % 4
                else:
                    npos, nd = (pos[0] + dx, pos[1] + dy), d
                if npos[0] not in xrange or npos[1] not in yrange:
                    continue
                if (npos, nd) in state or npos in blocked:
                    continue
                queue.append((npos, nd))
                graph[(npos, nd)] = ((pos, d), a)
        return None

    def _postprocess_obs(self, obs) -> tuple[str, dict[str, list[int]]]:
        """AgentGym's ``postprocess_obs``: the text description and the action table."""
        u = self._env.unwrapped
        view_size = u.agent_view_size
        pos = (int(u.agent_pos[0]), int(u.agent_pos[1]))
        f_vec = u.dir_vec
        r_vec = u.right_vec
        top_left = np.array(pos) + f_vec * (view_size - 1) - r_vec * (view_size // 2)
        borders = top_left + view_size * (-f_vec + r_vec)
        xb, yb = int(borders[0]), int(borders[1])
        tlx, tly = int(top_left[0]), int(top_left[1])
        xrange = range(xb, tlx + 1) if xb < tlx else range(tlx, xb)
        yrange = range(yb, tly + 1) if yb < tly else range(tly, yb)

        grid = obs["image"]
        d = int(obs["direction"])
        fx, fy = _DIRS[d]
        rx, ry = _DIRS[(d + 1) % 4]
        all_objs: list[dict] = []
        all_barriers: list[dict] = []
        for vis_j in range(view_size):
            for vis_i in range(view_size):
                abs_i = tlx - int(f_vec[0]) * vis_j + int(r_vec[0]) * vis_i
                abs_j = tly - int(f_vec[1]) * vis_j + int(r_vec[1]) * vis_i
                distance = abs(pos[0] - abs_i) + abs(pos[1] - abs_j)
                if abs_i < 0 or abs_j < 0 or distance == 0:
                    continue
                obj_type = IDX_TO_OBJECT[int(grid[vis_i, vis_j, 0])]
                if obj_type in ("door", "key", "ball", "box", "goal", "lava", "wall"):
                    color = IDX_TO_COLOR[int(grid[vis_i, vis_j, 1])]
                    if obj_type == "door":
                        name = color + " " + IDX_TO_STATE[int(grid[vis_i, vis_j, 2])] + " door"
                    else:
                        name = color + " " + obj_type
                    all_objs.append({"name": name, "abs_pos": (abs_i, abs_j), "dis": distance})
                if obj_type in ("box", "wall"):
                    rel = (abs_i - pos[0], abs_j - pos[1])
                    if fx * rel[1] - fy * rel[0] == 0:  # np.cross(dir, rel) == 0: straight ahead
                        all_barriers.append({"name": obj_type, "abs_pos": (abs_i, abs_j),
                                             "dis": fx * rel[0] + fy * rel[1]})
        all_objs.sort(key=lambda o: o["dis"])

        def offsets(o):
            rel = (o["abs_pos"][0] - pos[0], o["abs_pos"][1] - pos[1])
            return fx * rel[0] + fy * rel[1], rx * rel[0] + ry * rel[1]

        seen: list[tuple[str, int, int]] = []  # (name with its number, front, right), for compact
        if all_objs:
            cnt: dict[str, int] = {}
            desc = "In front of you in this room, you can see several objects: "
            for o in all_objs:
                if "wall" in o["name"]:
                    continue
                front, right = offsets(o)
                if right == 0:
                    where = "right in front of you " + str(front) + " steps away. "
                elif right > 0:
                    where = f"{front} steps in front of you and {right} steps to your right. "
                else:
                    where = f"{front} steps in front of you and {-right} steps to your left. "
                cnt[o["name"]] = cnt.get(o["name"], 0) + 1
                seen.append((o["name"] + " " + str(cnt[o["name"]]), front, right))
                desc += "There is a " + o["name"] + " " + str(cnt[o["name"]]) + " " + where + " "
        else:
            desc = "You cannot see any objects within sight."
        barrier_desc = "The room has walls around you. "
        if all_barriers:
            all_barriers.sort(key=lambda o: o["dis"])
            barrier_desc += (f"You are facing a {all_barriers[0]['name']} "
                             f"{all_barriers[0]['dis']} steps away. ")
        carrying = u.carrying
        if carrying is not None:
            carry_desc = "You are carrying a " + carrying.color + " " + carrying.type + "."
        else:
            carry_desc = "You are not carrying anything."
        description = desc + barrier_desc + carry_desc
        if self.compact:
            description = _compact_description(
                seen, (all_barriers[0]["name"], all_barriers[0]["dis"]) if all_barriers else None,
                None if carrying is None else carrying.color + " " + carrying.type)

        # ---- the action table (dict order is AgentGym's) ----
        blocked = {o["abs_pos"] for o in all_objs + all_barriers
                   if any(b in o["name"] for b in _BLOCKING)}

        def path_to(o, arrive):
            return self._find_path(pos, o["abs_pos"], blocked, d, xrange, yrange, arrive=arrive)

        actions: dict[str, list[int]] = {"turn left": [0], "turn right": [1]}
        errors: dict[str, str] = {}
        if not all_barriers or all_barriers[0]["dis"] > 1:
            actions["move forward"] = [2]
        else:
            errors["move forward"] = "There is a barrier in front of you, you can't move forward."

        if carrying is None and all_objs:
            cnt_obj: dict[str, int] = {}
            for o in all_objs:
                n = o["name"]
                if "wall" in n or "door" in n or "goal" in n:
                    continue
                p = path_to(o, False)
                if p is not None:
                    p.append(3)
                    if "pickup " + n + " 1" not in actions:
                        cnt_obj[n] = 1
                        actions["pickup " + n + " 1"] = p
                    else:
                        cnt_obj[n] += 1
                        actions["pickup " + n + " " + str(cnt_obj[n])] = p
                elif "pickup " + n + " 1" not in actions:
                    errors["pickup " + n + " 1"] = (
                        "You cannot pickup " + n + " 1, as there is no path leading to it.")
                else:
                    k = str(cnt_obj[n] + 1)
                    errors["pickup " + n + " " + k] = (
                        "You cannot pickup " + n + " " + k + ", as there is no path leading to it.")

        if carrying is not None:
            front_cell = (pos[0] + fx, pos[1] + fy)
            can_drop = not any(o["abs_pos"] == front_cell and any(b in o["name"] for b in _BLOCKING)
                               for o in all_objs)
            if can_drop:
                actions["drop"] = [4]
            else:
                errors["drop"] = ("You cannot drop the object, as there is already an object in "
                                  "front of you.")
        else:
            errors["drop"] = "You cannot drop the object, as you are not carrying anything."

        if all_objs:
            cnt_door: dict[str, int] = {}
            for o in all_objs:
                n = o["name"]
                if "door" in n:
                    cnt_door[n] = cnt_door.get(n, 0) + 1
                if "open door" in n:
                    key = "go through " + n + " " + str(cnt_door[n])
                    p = path_to(o, True)
                    if p is not None:
                        actions[key] = p
                    else:
                        errors[key] = ("You cannot go through " + n + " " + str(cnt_door[n])
                                       + ", as there is no path leading to it.")
                if "closed door" in n:
                    key = "toggle and go through " + n + " " + str(cnt_door[n])
                    p = path_to(o, False)
                    if p is not None:
                        actions[key] = p + [5, 2]
                    else:  # AgentGym prints the whole counter dict here; kept verbatim
                        errors[key] = ("You cannot toggle and go through " + n + " "
                                       + str(cnt_door) + ", as there is no path leading to it.")
                    if p == []:
                        actions["toggle"] = [5]
                    errors["go through " + n + " " + str(cnt_door[n])] = (
                        "You cannot go through " + n + " " + str(cnt_door[n])
                        + ", as it is closed. You should toggle it first.")
                if "locked door" in n:
                    key = "toggle and go through " + n + " " + str(cnt_door[n])
                    if carrying is None or carrying.type != "key":
                        errors[key] = ("You cannot toggle and go through " + n + " "
                                       + str(cnt_door[n]) + ", as you are not carrying a key.")
                        continue
                    if carrying.color != n.split(" ")[0]:
                        errors[key] = ("You cannot toggle and go through " + n + " "
                                       + str(cnt_door[n]) + ", as the color of the key you are "
                                       "carrying does not match the color of door.")
                        continue
                    p = path_to(o, False)
                    if p is not None:
                        actions[key] = p + [5, 2]
                    else:
                        errors[key] = ("You cannot toggle and go through " + n + " "
                                       + str(cnt_door) + ", as there is no path leading to it.")
                    if p == []:
                        actions["toggle"] = [5]

            for o in all_objs:
                if "goal" not in o["name"]:
                    continue
                p = path_to(o, True)
                if p is not None:
                    actions["go to goal"] = p
                else:
                    errors["go to goal"] = ("You cannot go to the goal, as there is no path "
                                            "leading to it.")

            cnt_goto: dict[str, int] = {}
            for o in all_objs:
                n = o["name"]
                if "wall" in n or "goal" in n:
                    continue
                p = path_to(o, False)
                if p is not None:
                    if "go to " + n + " 1" not in actions:
                        actions["go to " + n + " 1"] = p
                        cnt_goto[n] = 1
                    else:
                        cnt_goto[n] += 1
                        actions["go to " + n + " " + str(cnt_goto[n])] = p
                elif "go to " + n + " 1" not in actions:
                    errors["go to " + n + " 1"] = (
                        "You cannot go to " + n + " 1, as there is no path leading to it.")
                else:
                    k = str(cnt_goto[n] + 1)
                    errors["go to " + n + " " + k] = (
                        "You cannot go to " + n + " " + k + ", as there is no path leading to it.")

        actions["check available actions"] = []
        self.error_message = errors
        return description, actions
