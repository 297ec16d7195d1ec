"""A process-wide progress hook: the CLI installs a bar, library code reports to it.

Kept as a tiny callback so the library never depends on a terminal (Prefect workers and tests
run with no hook installed, and then reporting is a no-op).
"""

from __future__ import annotations

from collections.abc import Callable

_hook: Callable[[str, dict], None] | None = None


def install(hook: Callable[[str, dict], None] | None) -> None:
    global _hook
    _hook = hook


def report(event: str, **data: object) -> None:
    """Events: 'start' (total), 'iteration' (stage, horizon, global_step, metrics), 'turn'."""
    if _hook is not None:
        _hook(event, dict(data))
