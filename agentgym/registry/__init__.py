"""The MLflow model registry: the policy as a pyfunc model, its registration and the champion alias."""

from typing import TYPE_CHECKING

if not TYPE_CHECKING:
    def __getattr__(name):  # the former module agentgym.registry: its names, with a warning
        from agentgym._moved import forward
        return forward(__name__, name)
