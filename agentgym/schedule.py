"""ScalingInter-RL schedule: which stage (and horizon) a global step belongs to.

The stage is a pure function of the global step, so a run resumed at step ``k`` lands in
exactly the stage an uninterrupted run would be in at step ``k`` (AgentGym-RL's scheduler
counts one step off after a resume; this one cannot, because it keeps no state).

Global steps count RL iterations from 0 across all stages.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentgym.config import StageSpec


@dataclass(frozen=True)
class StagePosition:
    stage: int  # 0-based stage index
    horizon: int
    iteration: int  # 0-based iteration inside the stage
    global_step: int


def total_steps(stages: list[StageSpec]) -> int:
    return sum(s.iterations for s in stages)


def stage_start(stages: list[StageSpec], index: int) -> int:
    """Global step at which stage ``index`` starts."""
    return sum(s.iterations for s in stages[:index])


def _locate(stages: list[StageSpec], global_step: int) -> tuple[int, int] | None:
    """``(stage index, the stage's first global step)`` of ``global_step``; None past the schedule."""
    start = 0
    for i, spec in enumerate(stages):
        if start <= global_step < start + spec.iterations:
            return i, start
        start += spec.iterations
    return None


def position(stages: list[StageSpec], global_step: int) -> StagePosition:
    """Stage, horizon and in-stage iteration of ``global_step``."""
    if global_step < 0:
        raise ValueError(f"global_step must be >= 0, got {global_step}")
    found = _locate(stages, global_step)
    if found is None:
        raise ValueError(f"global_step {global_step} is past the schedule ({total_steps(stages)} steps)")
    i, start = found
    return StagePosition(i, stages[i].horizon, global_step - start, global_step)


def stage_tasks(stages: list[StageSpec], global_step: int) -> dict[str, list[int]]:
    """The training-task subsets (``StageSpec.tasks``, per environment name) of ``global_step``'s
    stage; ``{}`` where the stage names none or the step is past the schedule (every environment
    keeps all its tasks)."""
    found = _locate(stages, global_step)
    return dict(stages[found[0]].tasks or {}) if found else {}
