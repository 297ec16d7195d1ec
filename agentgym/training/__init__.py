"""Policy updates: the trainer protocol, the DeepSpeed trainer, the SFT warm start and the resident rank group."""

from typing import TYPE_CHECKING

if not TYPE_CHECKING:
    def __getattr__(name):  # the former module agentgym.training: its names, with a warning
        from agentgym._moved import forward
        return forward(__name__, name)
