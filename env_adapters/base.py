"""The text-environment interface every adapter implements.

Shaped like Gymnasium's ``reset``/``step``: the horizon cap is ``truncated`` (the rollout
loop owns it), ``terminated`` means the task itself ended (solved or failed for good).

Contract (checked by ``env_adapters.checker.check_env`` for every adapter):

* ``reset(task_id, seed)`` returns ``(observation, info)``; the same ``(task_id, seed)`` gives
  the same observation.
* ``step(action_text)`` takes the model's *raw reply* and returns a :class:`StepResult`. A reply
  that cannot be parsed is **never** an exception: the adapter returns a format-error
  observation, consumes the turn and sets ``info["format_error"] = True``.
* Rewards are floats in ``[0, 1]``.
* An infrastructure fault (server down, timeout, crashed simulator) raises :class:`InfraError`;
  the rollout marks the episode ``infra_error`` and keeps it out of the advantage baseline.
  It is never turned into a reward of 0.
* ``close()`` releases every resource (processes, JVMs, sockets) and is idempotent.
* ``task_category(task_id)`` (a classmethod) names the category held-out results are reported
  under; by default the environment's name.
"""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass, field
from typing import Any


class InfraError(RuntimeError):
    """The environment could not answer (dead server, timeout, crash): not the agent's fault."""


@dataclass
class StepResult:
    observation: str
    reward: float
    terminated: bool
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class TextEnv(abc.ABC):
    """One episode at a time; create one instance per concurrent episode."""

    #: short name used in configs and in the ``env`` column of the trajectory store
    name: str = "base"

    @abc.abstractmethod
    def reset(self, task_id: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
        """Start task ``task_id``; returns the first observation and an info dict."""

    @abc.abstractmethod
    def step(self, action_text: str) -> StepResult:
        """Apply the model's raw reply; never raises on a malformed reply."""

    def system_prompt(self) -> str:
        """Instructions shown once at the start of the conversation."""
        return ""

    @classmethod
    def task_category(cls, task_id: int) -> str:
        """The category held-out results are reported under for ``task_id`` (AgentGym-RL's
        per-category tables); one category, the environment's name, unless an adapter knows
        better. A classmethod: evaluation names categories without starting an environment."""
        return cls.name

    def valid_actions(self) -> list[str] | None:
        """The currently valid actions when the environment can list them (for baselines)."""
        return None

    def tools(self) -> list[dict[str, Any]] | None:
        """The functions the agent may call, in OpenAI's function format, for an environment whose
        actions are function calls (``env_adapters.tool_calls.ToolEnv``); None: text commands."""
        return None

    def context_summary(self) -> str | None:
        """The task and the current state as one self-contained observation, which can stand in
        for the turns before it (``rollout.context_policy: summary``); None: not provided."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; safe to call twice."""

    def __enter__(self) -> "TextEnv":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StateKeyedEnv(TextEnv):
    """A ``TextEnv`` that knows its environment state: ``reset`` and ``step`` put
    ``info["state_key"] = self.state_key()`` (the state after the call) on what the subclass's
    ``_reset`` / ``_step`` return. Equal keys are the same state however they were reached
    (GiGPO's step groups, ``algorithm.turn_baseline: state``)."""

    @abc.abstractmethod
    def state_key(self) -> str:
        """The current environment state as a string."""

    @abc.abstractmethod
    def _reset(self, task_id: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
        """``reset`` without the state key."""

    @abc.abstractmethod
    def _step(self, action_text: str) -> StepResult:
        """``step`` without the state key."""

    def reset(self, task_id: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
        obs, info = self._reset(task_id, seed)
        return obs, {**info, "state_key": self.state_key()}

    def step(self, action_text: str) -> StepResult:
        res = self._step(action_text)
        res.info["state_key"] = self.state_key()
        return res


def format_error(message: str, **info: Any) -> StepResult:
    """The observation returned for a reply the adapter cannot parse: the turn is consumed."""
    return StepResult(
        observation=message, reward=0.0, terminated=False, truncated=False,
        info={"format_error": True, **info},
    )


_SURROGATE = re.compile("[\ud800-\udfff]")


def utf8_safe(text: str) -> str:
    """``text`` with each lone surrogate replaced by U+FFFD. Invalid UTF-8 decoded with
    ``surrogateescape`` (or a JSON ``\\udcxx`` escape) gives such characters; they cannot be
    encoded as UTF-8, so a transport (HTTP JSON body, a JVM bridge) would raise on them instead
    of letting the adapter answer a format error."""
    return _SURROGATE.sub("\ufffd", text)
