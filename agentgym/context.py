"""Context policies: what the policy sees of a long conversation, and how an episode whose context
was cut is trained on exactly what the policy saw.

``truncate`` (the default) shows the whole conversation and ends the episode when the next prompt
would not fit. ``window`` and ``summary`` keep the conversation going by dropping old turns: the
context of reply ``k`` is a head (``window``: the system prompt and the first observation;
``summary``: the system prompt and the environment's state summary from before the kept turns)
followed by the last ``N`` turns whole (a turn: the reply and the observation it led to).

Token-in/token-out survives the cut. Each time the context changes other than by growing, the
rollout appends the new context to the episode's tokens as a **segment**: the head's and the kept
turns' ids copied (mask 0, log-prob 0), then the reply sampled under it (mask 1). An episode is
the concatenation of its segments; ``Episode.context_starts`` lists the token offsets where
segments after the first begin. Each segment is a prompt the engine saw, verbatim, followed by
what it sampled, so training a segment as its own row recomputes exactly the sampler's log-probs.
Every sampled token appears once (in the segment it was sampled in), so the runs of mask 1 are
still the episode's replies in order and the advantage step works on the episode layout as is.

:func:`split_rows` cuts rows of the episode layout into one row per segment for the trainer;
:func:`merge_segments` puts per-token results of those rows (values, log-probs) back.
"""

from __future__ import annotations

from typing import Any

import torch

from agentgym.config import ContextPolicy
from agentgym.types import segment_bounds

#: the per-token columns of a row of the episode layout (cut along the segments)
TOKEN_COLUMNS = ("input_ids", "loss_mask", "old_logprobs", "advantages", "returns", "old_values")


def split_rows(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[tuple[int, int, int]]]:
    """One row per segment of each row (rows without ``context_starts`` pass unchanged).

    Returns the segment rows and, for each, ``(row index, start, end)`` in its source row. Token
    columns are sliced; other keys are copied; ``context_starts`` is dropped from the result.
    ``action_starts`` / ``action_candidates`` (constrained replies) go to the segment holding
    each reply, offsets made relative to it. A segment without a sampled token (all mask 0) is
    left out: it has nothing to train.
    """
    out: list[dict[str, Any]] = []
    spans: list[tuple[int, int, int]] = []
    for i, r in enumerate(rows):
        starts = r.get("context_starts") or []
        base = {k: v for k, v in r.items() if k != "context_starts"}
        if not starts:
            out.append(base)
            spans.append((i, 0, len(r["input_ids"])))
            continue
        for a, b in segment_bounds(len(r["input_ids"]), list(starts)):
            if not any(r["loss_mask"][a:b]):
                continue
            seg = dict(base)
            for c in TOKEN_COLUMNS:
                if r.get(c) is not None:
                    seg[c] = list(r[c][a:b])
            if r.get("action_starts") is not None:
                kept = [(s - a, c) for s, c in zip(r["action_starts"], r["action_candidates"]) if a <= s < b]
                seg["action_starts"] = [s for s, _ in kept]
                seg["action_candidates"] = [c for _, c in kept]
            out.append(seg)
            spans.append((i, a, b))
    return out, spans


def merge_segments(values: torch.Tensor, spans: list[tuple[int, int, int]], shape: tuple[int, int]) -> torch.Tensor:
    """Per-token results of segment rows (``values``: (S, W), row ``s`` holding ``spans[s]``) laid
    back out as the episode layout (``shape`` = (B, T)); positions no segment covers are 0."""
    out = values.new_zeros(shape)
    for s, (i, a, b) in enumerate(spans):
        out[i, a:b] = values[s, : b - a]
    return out


__all__ = ["TOKEN_COLUMNS", "ContextPolicy", "merge_segments", "segment_bounds", "split_rows"]
