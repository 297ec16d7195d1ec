"""Compare two trainers' updates at the level where exactness is a float32 statement: the gradient.

Why not compare the weights after an AdamW step with a fixed ``atol``: AdamW's first step is
``lr * g / (|g| + eps)``, whose slope in ``g`` is ``lr * eps / (|g| + eps)**2``, up to
``lr / eps = 1e5`` at ``lr = 1e-3``. A gradient component that cancels to near zero (rows of
opposite advantage) carries a summation-order round-off of a few units of float32 round-off of
its *contributions*, and AdamW turns that into a weight difference of up to a few tenths of a
percent of a step, growing with the gradient's scale. A fixed weight ``atol`` therefore passes or
fails with the loss's scale and the machine's kernels, not with the exactness of the
accumulation (it failed for ``seq-mean-token-sum``, whose gradients are 8x larger than
``token-mean``'s on the same batch, on one machine of this kind and not another).

So: :class:`OptimizerSteps` records, through torch's global optimizer-step hooks (an observation
point, nothing is replaced), each step's flat gradient and parameters before and after, in the
optimizer's own layout (the same for ZeRO 0-3 with one rank); :func:`assert_same_gradient`
compares gradients relative to their scale; :func:`assert_step_is_adamw` checks that the weights
moved by AdamW's closed form of the recorded gradient, so the weight difference between two runs
is fully explained by their gradient difference.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

#: float32 unit round-off (2**-24).
F32_U = 2.0**-24
#: Allowed gradient difference in units of round-off of the gradient's largest component. Changing
#: the order of a sum of per-micro-batch contributions moves each component by a few such units
#: (the four aggregation modes and ZeRO 0-3, tiny model, 8 rows; how many a run reaches is not
#: recorded); a micro-batch weighted wrongly or dropped moves the gradient by about 1/8 of its
#: scale, 10**5 times more.
GRAD_ULPS = 16


def _flat(opt: torch.optim.Optimizer, what: str) -> torch.Tensor:
    """The optimizer's parameters (``what="param"``), gradients (``"grad"``) or a group setting
    broadcast to each parameter element (``"lr"``, ``"eps"``, ``"weight_decay"``), flat."""
    parts = []
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            t = p.grad if what == "grad" else p if what == "param" else torch.full_like(p, group[what])
            parts.append(t.detach().float().flatten().clone())
    return torch.cat(parts) if parts else torch.zeros(0)


class OptimizerSteps:
    """``with OptimizerSteps() as steps: trainer.train_on_batch(...)``; then ``steps.records``
    is one dict per optimizer step (every optimizer, in call order; DeepSpeed's ZeRO 1/2 steps
    one parameter group at a time): ``grad``, ``before``, ``after``, and each element's ``lr``,
    ``eps``, ``weight_decay``, all flat float32."""

    def __init__(self):
        self.records: list[dict] = []

    def __enter__(self) -> "OptimizerSteps":
        def pre(opt, args, kwargs):
            self.records.append({k: _flat(opt, k) for k in ("grad", "param", "lr", "eps", "weight_decay")})
            self.records[-1]["before"] = self.records[-1].pop("param")

        def post(opt, args, kwargs):
            self.records[-1]["after"] = _flat(opt, "param")

        self._handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()


def assert_same_gradient(want: torch.Tensor, got: torch.Tensor, what: str = "") -> float:
    """``|got - want| <= GRAD_ULPS * F32_U * max|want|`` componentwise; returns the observed
    difference in those units (for the test's printout)."""
    assert want.shape == got.shape, (what, want.shape, got.shape)
    scale = float(want.abs().max())
    assert scale > 0, f"{what}: zero gradient, nothing to compare"
    worst = float((got - want).abs().max())
    ulps = worst / (F32_U * scale)
    assert ulps <= GRAD_ULPS, f"{what}: gradients differ by {ulps:.1f} round-off units of max|g| {scale:.3e}"
    return ulps


def assert_step_is_adamw(record: dict) -> None:
    """The first AdamW step from zero moments with bias correction is
    ``p - lr * (wd * p + g / (|g| + eps))``: the recorded weights moved exactly so, to the
    round-off of torch's way of computing it (moments, bias corrections, sqrt, division and the
    update: about six rounded operations on numbers of the size of ``|p| + lr``; allowed 16
    units of round-off)."""
    g, p = record["grad"], record["before"]
    want = p * (1 - record["lr"] * record["weight_decay"]) - record["lr"] * g / (g.abs() + record["eps"])
    tol = 16 * F32_U * (p.abs() + record["lr"])
    bad = ((record["after"] - want).abs() > tol).sum().item()
    assert bad == 0, f"{bad} weights did not move by AdamW's first step of the recorded gradient"
