"""The trajectory store: Parquet tables over fsspec, committed per iteration, and its refusals."""

from typing import TYPE_CHECKING

if not TYPE_CHECKING:
    def __getattr__(name):  # the former module agentgym.store: its names, with a warning
        from agentgym._moved import forward
        return forward(__name__, name)
