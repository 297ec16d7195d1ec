"""Patch of minigrid, written for 3.x (``minigrid>=3,<4`` in pyproject.toml; the patched prints
read in the 2.2 - 3.1 sources; pinned and tested: 3.2.0).

* :func:`silence_rejected_samples`: the BabyAI level generator stops printing every rejected
  level sample to stdout.
"""

from __future__ import annotations

from typing import Any

from agentgym.patches import require_source, require_version

SUPPORTED = ">=3.0,<4"


def _silent_print(*args: Any, **kwargs: Any) -> None:
    """``print`` for minigrid's ``roomgrid_level`` module: prints nothing."""
    return None


def silence_rejected_samples() -> None:
    """Silence ``print`` in ``minigrid.envs.babyai.core.roomgrid_level`` (that module only).

    ``RoomGridLevel._gen_grid`` generates a BabyAI level by rejection sampling and prints every
    rejected sample (``Sampling rejected: ...``, and ``Timeout during mission generation: ...`` on
    a ``RecursionError``) to stdout: a BabyAI environment server or a rollout would fill its
    output with them. A module global ``print`` shadows the builtin for that module only;
    swapping ``sys.stdout`` instead would race with other threads. minigrid has no option for
    it. Idempotent; process-wide for that module.
    """
    name = f"{__name__}.silence_rejected_samples"
    check = ("that RoomGridLevel._gen_grid in minigrid/envs/babyai/core/roomgrid_level.py still "
             "reports rejected samples with print() (and nothing else there needs print)")
    require_version(name, "minigrid", SUPPORTED, check)
    from minigrid.envs.babyai.core import roomgrid_level

    if roomgrid_level.__dict__.get("print") is _silent_print:
        return
    require_source(name, roomgrid_level.RoomGridLevel._gen_grid, ('print("Sampling rejected:"',), check)
    roomgrid_level.print = _silent_print  # type: ignore[attr-defined]


__all__ = ["SUPPORTED", "silence_rejected_samples"]
