"""Held-out evaluation: Avg@k / Pass@k, before/after tables, learning curves, run inspection and the viewer."""

from typing import TYPE_CHECKING

if not TYPE_CHECKING:
    def __getattr__(name):  # the former module agentgym.evaluation: its names, with a warning
        from agentgym._moved import forward
        return forward(__name__, name)
