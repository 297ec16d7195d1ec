"""Patches of DeepSpeed, written for 0.16 - 0.19 (read in the 0.16.0 - 0.19.x sources; pinned
and tested: 0.19.8, constraints/*.txt).

* :func:`skip_shm_comm_build`: no compile of the CPU shared-memory comm op (process-wide, CPU only);
* :func:`exclude_frozen_aliases`: checkpoints without frozen parameters drop their tied aliases too
  (one engine);
* :func:`step_without_bookkeeping`: an ``engine.step()`` that leaves the LR schedule, the step
  counters and the lazily linked optimizer state as they were (one engine, one step).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from typing import Any

from agentgym.patches import require_attribute, require_version

SUPPORTED = ">=0.16,<0.20"


def _no_shm_op() -> None:
    """What ``build_shm_op`` returns when the op cannot be built: no shared-memory comm op."""
    return None


_no_shm_op._agentgym_patch = True  # type: ignore[attr-defined]


def skip_shm_comm_build() -> None:
    """Stop DeepSpeed from compiling its CPU shared-memory comm op (a C++ build, the first time).

    ``deepspeed.comm.torch.TorchBackend.__init__`` calls the module function ``build_shm_op()``,
    which on the CPU accelerator JIT-compiles ``ShareMemCommBuilder`` in every fresh process
    (and rank) that has no build cached. The op only serves ``inference_all_reduce``
    (tensor-parallel inference); training collectives (all-reduce, reduce-scatter, all-gather of
    ZeRO) go through gloo whether it is built or not, so the compile costs each fresh machine a
    compiler run and buys training nothing. ``build_shm_op`` is replaced by a function returning
    None, DeepSpeed's own answer when the op is not available. CUDA machines use NCCL and are
    left alone. Idempotent; process-wide.
    """
    import torch

    if torch.cuda.is_available():
        return
    name = f"{__name__}.skip_shm_comm_build"
    check = ("that deepspeed/comm/torch.py still defines build_shm_op() and TorchBackend.__init__ "
             "still calls it, treating None as 'no shm op'")
    require_version(name, "deepspeed", SUPPORTED, check)
    # (`deepspeed.comm.torch` as an attribute is the torch package itself: import the module.)
    module = importlib.import_module("deepspeed.comm.torch")
    current = require_attribute(name, module, "build_shm_op", check, params=())
    if getattr(current, "_agentgym_patch", False):
        return
    module.build_shm_op = _no_shm_op  # type: ignore[attr-defined]  # the monkeypatch


_MODULE_STATE_DICT_PARAMS = ("destination", "prefix", "keep_vars", "exclude_frozen_parameters")


def exclude_frozen_aliases(engine: Any) -> None:
    """Make ``engine.module_state_dict(exclude_frozen_parameters=True)`` drop every name of a
    frozen tensor, on this engine only.

    DeepSpeed's ``DeepSpeedEngine.module_state_dict`` removes frozen parameters by the names
    ``module.named_parameters()`` yields, which lists a tensor shared by several names (a tied
    ``lm_head.weight`` = ``embed_tokens.weight``) under its first name only: the alias stays in
    the state dict, and LoRA checkpoints (which must hold the adapters alone) carry a copy of the
    frozen embedding. The wrapper calls the original, then pops every frozen name from
    ``named_parameters(remove_duplicate=False)``. Idempotent per engine.
    """
    name = f"{__name__}.exclude_frozen_aliases"
    check = ("that DeepSpeedEngine.module_state_dict(destination, prefix, keep_vars, "
             "exclude_frozen_parameters) still removes frozen parameters by named_parameters() "
             "names (and whether it now removes tied aliases itself)")
    require_version(name, "deepspeed", SUPPORTED, check)
    if getattr(getattr(engine, "module_state_dict", None), "_agentgym_patch", False):
        return
    original = require_attribute(name, engine, "module_state_dict", check, params=_MODULE_STATE_DICT_PARAMS)

    def module_state_dict(*args: Any, exclude_frozen_parameters: bool = False, **kwargs: Any) -> Any:
        sd = original(*args, exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)
        if exclude_frozen_parameters:
            for n, p in engine.module.named_parameters(remove_duplicate=False):
                if not p.requires_grad:
                    sd.pop(n, None)
        return sd

    module_state_dict._agentgym_patch = True  # type: ignore[attr-defined]
    engine.module_state_dict = module_state_dict


# DeepSpeed optimizers that link AdamW's per-parameter state to theirs lazily, on their first
# step, and record it in ``_hp_optimizer_states_linked`` (module, class).
_LAZY_LINKING_OPTIMIZERS = (
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"),
    ("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer"),
)


@contextlib.contextmanager
def step_without_bookkeeping(engine: Any) -> Iterator[None]:
    """Inside, ``engine.step()`` does DeepSpeed's end-of-step work (clearing each stage's gradient
    buffers its own way) without the bookkeeping of an applied step: the LR schedule does not
    advance, ``global_steps`` and ``global_samples`` stay, ``skipped_steps`` counts one more, and
    a ZeRO 1/2 or bf16 optimizer does not link its optimizer state yet. The caller switches off
    the inner optimizer's step itself (``training.FiniteWatch``); this is the DeepSpeed half.

    What it relies on in DeepSpeed: ``DeepSpeedEngine._take_model_step`` steps ``lr_scheduler``
    only when it is not None and advances ``global_steps`` / ``global_samples`` afterwards (so
    they are put back on exit); ``DeepSpeedZeroOptimizer`` and ``BF16_Optimizer`` link AdamW's
    per-parameter state after their first step unless ``_hp_optimizer_states_linked`` is True,
    which with no state yet would add empty entries to it, so it is set True for the skipped
    step and put back after.
    """
    name = f"{__name__}.step_without_bookkeeping"
    check = ("DeepSpeedEngine._take_model_step (lr_scheduler stepped only when not None; "
             "global_steps, global_samples, skipped_steps) and _hp_optimizer_states_linked in "
             "DeepSpeedZeroOptimizer and BF16_Optimizer")
    require_version(name, "deepspeed", SUPPORTED, check)
    for attribute in ("lr_scheduler", "global_steps", "global_samples", "skipped_steps", "optimizer"):
        require_attribute(name, engine, attribute, check)
    opt = engine.optimizer
    for module_name, class_name in _LAZY_LINKING_OPTIMIZERS:
        cls = getattr(sys.modules.get(module_name), class_name, None)  # loaded if opt can be one
        if cls is not None and isinstance(opt, cls):
            require_attribute(name, opt, "_hp_optimizer_states_linked", check)

    e = engine
    scheduler, steps, samples, skipped = e.lr_scheduler, e.global_steps, e.global_samples, e.skipped_steps
    e.lr_scheduler = None  # DeepSpeed steps the schedule only when it has one
    unlinked = getattr(opt, "_hp_optimizer_states_linked", None) is False
    if unlinked:
        opt._hp_optimizer_states_linked = True
    try:
        yield
    finally:
        if unlinked:
            opt._hp_optimizer_states_linked = False
        e.lr_scheduler = scheduler
        e.global_steps, e.global_samples, e.skipped_steps = steps, samples, skipped + 1


__all__ = ["SUPPORTED", "exclude_frozen_aliases", "skip_shm_comm_build", "step_without_bookkeeping"]
