"""A multi-turn, dense-reward test environment (a test helper, not a test module).

``MultiTurnCharShare``: ``turns`` turns per episode; turn k's reward is the share of its reply's
non-space characters that are in ``target``, divided by ``turns`` (so the turn rewards add up to
an outcome in [0, 1]). A randomly initialised tiny model can climb it, and its turns have their
own rewards: what turn-level credit assignment needs. ``install(monkeypatch)`` registers it
in ``env_adapters.ADAPTERS`` under the name ``multi_char_share``.
"""

from __future__ import annotations

from typing import Any

from env_adapters.base import StepResult, TextEnv

NAME = "multi_char_share"


class MultiTurnCharShare(TextEnv):
    name = NAME

    def __init__(self, target: str = "aeiou", turns: int = 2, flag_invalid: bool = False):
        self.target, self.turns = target, int(turns)
        self.flag_invalid = bool(flag_invalid)  # a reply without any target letter is "invalid"
        self.k, self.task = 0, -1

    def system_prompt(self) -> str:
        return "You are a helpful assistant. Follow the instruction exactly."

    def reset(self, task_id: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
        self.k, self.task = 0, int(task_id)
        return f"Task {task_id}: write a reply using only the letters '{self.target}'.", {}

    def step(self, action_text: str) -> StepResult:
        chars = [c for c in action_text.strip() if not c.isspace()]
        share = sum(c in self.target for c in chars) / len(chars) if chars else 0.0
        self.k += 1
        done = self.k >= self.turns
        obs = "Done." if done else f"Again: only the letters '{self.target}'."
        invalid = self.flag_invalid and bool(chars) and share == 0.0
        return StepResult(obs, share / self.turns, done, False,
                          {"success": False, "format_error": not chars, "invalid_action": invalid})


def install(monkeypatch) -> None:
    """Register the env under ``NAME`` in the adapter table (as a user would add a line there)."""
    import env_adapters

    monkeypatch.setitem(env_adapters.ADAPTERS, NAME, f"{__name__}:MultiTurnCharShare")
