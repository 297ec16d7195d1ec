import random

import pytest

from agentgym.config import StageSpec, parse_config
from agentgym.schedule import position, stage_start, total_steps

STAGES = [StageSpec(horizon=6, iterations=3), StageSpec(horizon=13, iterations=2),
          StageSpec(horizon=20, iterations=4)]


def test_positions_cover_every_step_in_order():
    seen = [position(STAGES, g) for g in range(total_steps(STAGES))]
    assert [(p.stage, p.iteration) for p in seen] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (2, 3)]
    assert [p.horizon for p in seen] == [6, 6, 6, 13, 13, 20, 20, 20, 20]


def test_stage_boundaries():
    assert [stage_start(STAGES, i) for i in range(3)] == [0, 3, 5]
    # the first step of each stage already has that stage's horizon (no off-by-one on resume)
    assert [position(STAGES, k).horizon for k in (2, 3, 4, 5)] == [6, 13, 13, 20]


@pytest.mark.parametrize("seed", range(25))
def test_position_is_the_expanded_schedule_and_resume_arithmetic_agrees(seed):
    """Against a plain expansion of random schedules: the step -> (stage, horizon, iteration)
    map, and the flow's resume arithmetic (``stage_start(stage) + iteration == step``, the
    ``start_iteration`` a resumed stage restarts at)."""
    rng = random.Random(seed)
    stages = [StageSpec(horizon=rng.randint(1, 30), iterations=rng.randint(1, 5))
              for _ in range(rng.randint(1, 5))]
    expanded = [(i, s.horizon, j) for i, s in enumerate(stages) for j in range(s.iterations)]
    assert total_steps(stages) == len(expanded)
    for step, (stage, horizon, iteration) in enumerate(expanded):
        p = position(stages, step)
        assert (p.stage, p.horizon, p.iteration, p.global_step) == (stage, horizon, iteration, step)
        assert stage_start(stages, p.stage) + p.iteration == step
    with pytest.raises(ValueError, match="past the schedule"):
        position(stages, len(expanded))


def test_rounds_shorthand_schedules_like_explicit_stages():
    short = parse_config({"schedule": {"rounds": [6, 13], "steps_per_stage": 2}}).stages
    assert [position(short, k).horizon for k in range(4)] == [6, 6, 13, 13]


@pytest.mark.parametrize("bad", [-1, 9])
def test_out_of_range(bad):
    with pytest.raises(ValueError):
        position(STAGES, bad)
