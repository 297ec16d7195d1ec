"""``agentgym.training.finite.all_finite`` (FiniteWatch's per-gradient check) agrees with
``torch.isfinite(t).all()`` -- the closed form -- wherever a NaN or an infinity sits (every
position of tensors whose sizes cover vectorised bodies and their tails), in fp32 and bf16."""

import pytest
import torch

from agentgym.training.finite import all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [1, 7, 8, 33, 257])
def test_all_finite_finds_every_nan_and_inf_wherever_it_sits(dtype, n):
    base = torch.randn(n, dtype=dtype)
    assert bool(all_finite(base)) and bool(torch.isfinite(base).all())
    for bad in (float("nan"), float("inf"), -float("inf")):
        for i in range(n):
            t = base.clone()
            t[i] = bad
            assert not bool(all_finite(t)), (bad, i)
            assert bool(all_finite(t)) == bool(torch.isfinite(t).all())


def test_all_finite_on_shapes_extremes_and_empty():
    assert bool(all_finite(torch.zeros(0)))  # nothing to be non-finite (isfinite(empty).all() is True too)
    big = torch.full((3, 5), torch.finfo(torch.float32).max)
    big[1, 2] = -torch.finfo(torch.float32).max
    assert bool(all_finite(big))  # the largest finite values are finite
    grid = torch.randn(64, 48)
    grid[63, 47] = float("nan")
    assert not bool(all_finite(grid)) and not bool(all_finite(grid.t()))  # a non-contiguous view too
    x = torch.randn(4, 4, requires_grad=True)
    assert all_finite(x).dtype == torch.bool and all_finite(x).shape == ()
