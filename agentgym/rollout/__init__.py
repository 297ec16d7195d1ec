"""The multi-turn rollout: the loop (``loop``), the environment thread pools and the inference engines."""

from typing import TYPE_CHECKING

if not TYPE_CHECKING:
    def __getattr__(name):  # the former module agentgym.rollout: its names, with a warning
        from agentgym._moved import forward
        return forward(__name__, name)
