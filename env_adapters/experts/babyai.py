"""A BabyAI expert that plans over the adapter's compound actions.

The adapter lists what the agent can do from where it stands: ``go to <obj> <n>``, ``pickup
<obj> <n>``, ``toggle and go through <door> <n>``... each of which walks there by itself. So the
expert only has to read the mission, find the object it names among the listed actions, and
look around when the object is not in view:

* ``go to X`` / ``pick up X`` / ``open X`` (a door) -- the matching listed action when X is
  visible and reachable;
* otherwise explore: turn left up to three times (a full look around), then step forward, go
  through an open door or open a closed one, and look around again.

Missions joined by "and" (the adapter rewrites "then" / "after you" so) are done left to right.
It solves the GoTo, Pickup and Open families' single-room levels nearly always (tested: the
demonstration levels of the quickstart) and is not meant for PutNext, Unlock or the Boss levels.
"""

from __future__ import annotations

import random
import re
from typing import Any

from env_adapters.base import TextEnv
from env_adapters.experts.base import Expert

_COLORS = ("red", "green", "blue", "purple", "yellow", "grey")
_TYPES = ("ball", "box", "key", "door")
_VERBS = {"go to": "go to", "pick up": "pickup", "open": "open"}
_GOAL = re.compile(r"(go to|pick up|open)\s+(?:the|a)\s+(?:(" + "|".join(_COLORS) + r")\s+)?("
                   + "|".join(_TYPES) + r")")


def parse_mission(mission: str) -> list[tuple[str, str | None, str]]:
    """``"go to the red ball and pick up a key"`` -> ``[("go to", "red", "ball"), ("pickup", None, "key")]``."""
    return [(_VERBS[v], color or None, kind) for v, color, kind in _GOAL.findall(mission.lower())]


def _matches(name: str, color: str | None, kind: str) -> bool:
    """Whether a listed object name (``"red ball"``, ``"blue closed door"``) is the mission's."""
    words = name.split()
    return words[-1] == kind and (color is None or words[0] == color)


class BabyAIExpert(Expert):
    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._subgoals: list[tuple[str, str | None, str]] = []
        self._env: Any = None
        self._turns_in_place = 0

    def reset(self, env: TextEnv, observation: str, info: dict[str, Any]) -> None:
        self._env = env
        self._subgoals = parse_mission(info.get("mission", ""))
        self._turns_in_place = 0

    def act(self, observation: str) -> str | None:
        if not self._subgoals:
            return None  # a mission this expert does not read
        actions = list(self._env.valid_actions() or [])
        verb, color, kind = self._subgoals[0]
        chosen = self._achieve(actions, verb, color, kind)
        if chosen is not None:
            # the adapter's step ends the subgoal (the object is reached or held); a sequence
            # mission moves on to its next part
            if len(self._subgoals) > 1 and not chosen.startswith(("turn", "move")):
                self._subgoals.pop(0)
            self._turns_in_place = 0
            return chosen
        return self._explore(actions)

    def _achieve(self, actions: list[str], verb: str, color: str | None, kind: str) -> str | None:
        if verb == "open":  # "toggle and go through <color> closed door <n>" opens it on the way
            prefix = "toggle and go through "
        else:
            prefix = verb + " "
        for a in actions:
            if not a.startswith(prefix):
                continue
            name = a[len(prefix):].rsplit(" ", 1)[0]
            if verb == "open" and "locked" in name:
                continue
            if _matches(name, color, kind):
                return a
        if verb == "open":  # already in front of it: toggle
            if "toggle" in actions and self._facing_door(color):
                return "toggle"
        return None

    def _facing_door(self, color: str | None) -> bool:
        u = self._env._env.unwrapped
        cell = u.grid.get(*u.front_pos)
        return cell is not None and cell.type == "door" and (color is None or cell.color == color)

    def _explore(self, actions: list[str]) -> str:
        if self._turns_in_place < 3:
            self._turns_in_place += 1
            return "turn left"
        self._turns_in_place = 0
        doors = [a for a in actions if a.startswith(("go through", "toggle and go through"))]
        if doors and (self._rng.random() < 0.5 or "move forward" not in actions):
            return self._rng.choice(doors)
        if "move forward" in actions:
            return "move forward"
        return "turn left"
