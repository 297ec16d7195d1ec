"""What a run records about itself: MLflow tracking, Prefect artifact keys, run summaries, full-database errors."""

from typing import TYPE_CHECKING

if not TYPE_CHECKING:
    def __getattr__(name):  # the former module agentgym.tracking: its names, with a warning
        from agentgym._moved import forward
        return forward(__name__, name)
