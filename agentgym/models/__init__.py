"""Model folders: names to local HF folders, the model cache, the packaged SmolLM2, the tiny test model."""

from typing import TYPE_CHECKING

if not TYPE_CHECKING:
    def __getattr__(name):  # the former module agentgym.models: its names, with a warning
        from agentgym._moved import forward
        return forward(__name__, name)
