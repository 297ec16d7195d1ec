import pytest

from agentgym.config import StageSpec
from agentgym.schedule import horizon_at, position, stage_start, total_steps

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
    assert horizon_at(STAGES, 2) == 6 and horizon_at(STAGES, 3) == 13 and horizon_at(STAGES, 5) == 20


def test_resume_lands_in_same_stage():
    # a run resumed at step k computes its position from k alone: same answer as uninterrupted
    for k in range(total_steps(STAGES)):
        assert position(STAGES, k) == position(list(STAGES), k)


@pytest.mark.parametrize("bad", [-1, 9])
def test_out_of_range(bad):
    with pytest.raises(ValueError):
        position(STAGES, bad)
