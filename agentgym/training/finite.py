"""Non-finite losses and gradients: noticing them and skipping the optimizer step that would apply them."""

from __future__ import annotations

import contextlib
import types
from typing import Any, Iterator

import torch

from agentgym.patches.deepspeed import step_without_bookkeeping


class NonFiniteTrainingError(RuntimeError):
    """``trainer.max_nonfinite_skips`` optimizer steps in a row had a non-finite loss or gradient."""


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """Whether every element of ``t`` is finite, as a 0-d bool tensor (no device sync).

    From its least and greatest elements (``torch.aminmax``: one reduction, NaN-propagating):
    both are finite exactly when every element is. ``torch.isfinite(t).all()`` gives the same
    answer through full-size temporaries (``abs``, two comparisons, an ``and``), and the check
    runs on every trained parameter's gradient of every micro-batch, where those temporaries
    showed in bench/roofline.py's profile of the update."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    lo, hi = torch.aminmax(t.detach())
    return torch.isfinite(lo) & torch.isfinite(hi)


class FiniteWatch:
    """Notices non-finite gradients reaching one DeepSpeed engine's trainable parameters, and
    lets that engine's next ``step()`` apply nothing (``skipping``).

    Why hooks: where gradients live after the backward depends on the ZeRO stage and on bf16
    (``p.grad``, a ZeRO partition, the bf16 optimizer's fp32 buffer), but at every stage each
    micro-batch's gradient passes through its parameter's autograd hook first, whole, before
    DeepSpeed reduces or partitions it. A sum with a non-finite term is non-finite, so checking
    the terms checks the accumulated gradient.

    Why a switched-off inner step rather than no ``engine.step()``: DeepSpeed's own overflow
    check skips NaN gradients under ZeRO 1-3 and its bf16 optimizer, but not at ZeRO-0 in fp32
    (a NaN gradient there became NaN weights: clipping by a NaN norm), and it still advances its
    step counters. Calling ``engine.step()`` with the AdamW step turned off lets each stage clear
    its gradient buffers its own way while nothing is applied.

    Built before ``deepspeed.initialize`` (on the module and the AdamW passed to it), so the LR
    scheduler DeepSpeed builds wraps the guarded step and sees no override.
    """

    def __init__(self, module: torch.nn.Module, base_optimizer: torch.optim.Optimizer):
        self.engine: Any = None  # the DeepSpeed engine, set once initialized
        self._finite: list[torch.Tensor] = []  # one flag per hooked gradient since the last take()
        for p in module.parameters():  # ZeRO-3 partitions these same Parameter objects in place
            if p.requires_grad:
                p.register_hook(self._check)
        self._skip = False
        inner_step = base_optimizer.step

        def step(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            return None if self._skip else inner_step(*args, **kwargs)

        # a bound method, as torch's LR scheduler expects to find (it wraps ``step.__func__``)
        base_optimizer.step = types.MethodType(step, base_optimizer)  # type: ignore[method-assign]

    def _check(self, grad: torch.Tensor) -> None:
        # a tensor, not bool(): no device sync per parameter; read once per optimizer step
        self._finite.append(all_finite(grad))

    def take(self) -> bool:
        """Whether every gradient seen since the last call was finite; forgets them."""
        flags, self._finite = self._finite, []
        return bool(torch.stack([f.cpu() for f in flags]).all()) if flags else True

    @contextlib.contextmanager
    def skipping(self) -> Iterator[None]:
        """``engine.step()`` inside applies nothing: no AdamW step (weights and moments stay),
        the learning-rate schedule does not advance, DeepSpeed's step counters stay (its
        ``skipped_steps`` counts the step); the gradients are cleared as after any step."""
        with step_without_bookkeeping(self.engine):  # the DeepSpeed half (agentgym.patches)
            self._skip = True
            try:
                yield
            finally:
                self._skip = False
