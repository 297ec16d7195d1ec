"""One SHA-256 over a model's weights, to check that a sync delivered exactly the trained ones."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


def weights_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over (name, float32 bytes) of every tensor, sorted by name: equal weights under
    equal names give equal digests whatever order or dtype they were produced in (bf16 and fp32
    copies of the same values agree)."""
    h = hashlib.sha256()
    for name, t in sorted(((n, t) for n, t in named), key=lambda x: x[0]):
        h.update(name.encode())
        h.update(t.detach().float().contiguous().reshape(-1).cpu().numpy().tobytes())
    return h.hexdigest()
