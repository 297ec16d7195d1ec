"""The synthetic training batch the trainer tests share (tests/ is on sys.path)."""

from __future__ import annotations

import torch

from agentgym.training.batch import TrainBatch


def synthetic_rows(vocab: int = 512, n: int = 8, seed: int = 0, *, returns: bool = False,
                   empty_row: int | None = None, segments: int = 2, ids: bool = False) -> list[dict]:
    """``n`` rows of lengths 12, 13, ...: random token ids in [6, vocab), a 5-token prompt, then
    ``segments`` (1 or 2) policy segments; old log-probs -3, advantages -1/0/+1 by row; row
    ``empty_row`` (if given) has no policy token. ``returns``: the critic's targets (a per-row
    level plus a ramp along the row). ``ids``: an ``episode_id`` per row (``e<i>``)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = 12 + i
        token_ids = torch.randint(6, vocab, (length,), generator=g).tolist()
        if segments == 1:
            mask = [0] * 5 + [1] * (length - 5)
        else:
            mask = [0] * 5 + [1] * 4 + [0] * 2 + [1] * (length - 11)
        if i == empty_row:
            mask = [0] * length
        row = {"input_ids": token_ids, "loss_mask": mask,
               "old_logprobs": [(-3.0 if m else 0.0) for m in mask],
               "advantages": [(float(i % 3) - 1.0) * m for m in mask]}
        if returns:
            row["returns"] = [(0.2 * (i % 4) + 0.02 * t) * m for t, m in enumerate(mask)]
        if ids:
            row = {"episode_id": f"e{i}", **row}
        rows.append(row)
    return rows


def synthetic_batch(vocab: int = 512, n: int = 8, seed: int = 0, **kw) -> TrainBatch:
    """:func:`synthetic_rows` padded into a ``TrainBatch`` (pad id 0)."""
    return TrainBatch.from_rows(synthetic_rows(vocab, n, seed, **kw), pad_id=0)


def mask_runs(mask: list[int]) -> list[tuple[int, int]]:
    """The ``[start, end)`` spans of consecutive 1s in a loss mask: an episode's sampled replies."""
    out, i = [], 0
    while i < len(mask):
        if mask[i]:
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            out.append((i, j))
            i = j
        else:
            i += 1
    return out
