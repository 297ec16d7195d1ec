"""Replaying a simulator's gold action sequence: the shared part of the ScienceWorld and
TextWorldExpress experts.

Both adapters can ask their simulator for the gold action sequence of the loaded task
(``env.gold_actions()``), but only when the task was loaded with ``gold_path=True``. The
demonstrations create environments with their configured kwargs (usually without it), so
:meth:`GoldSequenceExpert.reset` switches it on and reloads the same task (same ``task_id`` and
``seed``: the same world, and we are still at its first turn). Each action is returned in the
adapter's normal form (``simulator_command``: lower case, ``[a-z0-9 -]``), so it parses to
itself; both simulators match actions case-insensitively (the TextWorldExpress adapter restores
the case of the valid action).

A replay does not look at the observations: a turn that is not the expert's (a DART noise
action) can put it off the gold path, and the episode may then fail.
"""

from __future__ import annotations

from typing import Any

from env_adapters.base import TextEnv
from env_adapters.experts.base import Expert
from env_adapters.parsing import simulator_command


class GoldSequenceExpert(Expert):
    """Replays ``env.gold_actions()`` in order; gives up (``None``) when it runs out."""

    def __init__(self) -> None:
        self._actions: list[str] = []

    def reset(self, env: TextEnv, observation: str, info: dict[str, Any]) -> None:
        if not getattr(env, "gold_path", False):
            # the gold path is generated at load time: reload the task with it
            env.gold_path = True  # type: ignore[attr-defined]
            env.reset(info["task_id"], info.get("seed", 0))
        actions = [simulator_command(a) for a in env.gold_actions()]  # type: ignore[attr-defined]
        self._actions = self.shorten(actions)

    def shorten(self, actions: list[str]) -> list[str]:
        """The sequence to play. Both adapters' first observation already is ``look around``'s
        answer, so a leading ``look around`` only spends a turn."""
        return actions[1:] if actions[:1] == ["look around"] else actions

    def act(self, observation: str) -> str | None:
        return self._actions.pop(0) if self._actions else None
