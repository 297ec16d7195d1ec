"""The scripted-expert interface."""

from __future__ import annotations

import abc
from typing import Any

from env_adapters.base import TextEnv


class Expert(abc.ABC):
    """A scripted policy for one environment.

    ``reset`` is called right after ``env.reset(task_id, seed)`` with that call's observation and
    info; ``act`` then gets each observation in turn and returns the bare action text (for
    example ``"go to red ball 1"``), or ``None`` to give up (the episode is dropped from the
    demonstrations). The expert may read the adapter's internals (``env``): it is privileged.
    """

    @abc.abstractmethod
    def reset(self, env: TextEnv, observation: str, info: dict[str, Any]) -> None:
        """Start a new episode of ``env``."""

    @abc.abstractmethod
    def act(self, observation: str) -> str | None:
        """The next action (bare text, no ``Action:`` prefix), or ``None`` to give up."""
