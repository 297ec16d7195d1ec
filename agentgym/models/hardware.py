"""What the hardware does fast: decides ``dtype: auto`` and ``trainer.bf16: auto``.

bf16 is only fast where the hardware has bf16 arithmetic: a CUDA GPU that supports it, or an x86
CPU with AVX512-BF16 or AMX. Elsewhere PyTorch emulates it, which is slower than fp32 (timed only
ad hoc, so no figure is given: docs/results.md, "What the compute costs here").
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_bf16(flags: Iterable[str]) -> bool:
    """Whether a CPU with these ``/proc/cpuinfo`` flags computes bf16 natively (AVX512-BF16 or AMX);
    also what a bench record's ``machine.cpu_flags`` says about the run it holds."""
    return not set(_BF16_CPU_FLAGS).isdisjoint(flags)


@lru_cache(maxsize=1)
def bf16_is_fast() -> bool:
    """True on a CUDA device with bf16 support or a CPU with bf16 instructions."""
    import torch

    if torch.cuda.is_available():
        return bool(torch.cuda.is_bf16_supported())
    try:
        flags = set()
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags.update(line.split(":", 1)[1].split())
                break
    except OSError:
        return False
    return cpu_has_bf16(flags)


def resolve_dtype(dtype: str) -> str:
    """``"auto"`` -> ``"bfloat16"`` where bf16 is fast, else ``"float32"``; others unchanged."""
    if dtype == "auto":
        return "bfloat16" if bf16_is_fast() else "float32"
    return dtype


def resolve_bf16(flag: bool | str) -> bool:
    """``trainer.bf16``: ``"auto"`` -> whether bf16 is fast here; a bool unchanged."""
    return bf16_is_fast() if flag == "auto" else bool(flag)


def resolve_device(device: str) -> str:
    """``rollout.device``: ``"auto"`` -> ``"cuda"`` where a CUDA GPU is visible, else ``"cpu"``;
    ``"cuda"`` without one is refused with the fix."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("rollout.device=cuda but no CUDA GPU is visible to this process (torch."
                           "cuda.is_available() is False); set rollout.device: auto or cpu")
    return device
