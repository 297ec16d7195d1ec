"""The padded tensors of one policy update (``TrainBatch``): what every trainer steps on."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentgym.training.action_logprob import RowChoices


@dataclass
class TrainBatch:
    """Padded tensors for one update. Shapes (B, T); mask meaning as in ``agentgym.types``."""

    input_ids: torch.Tensor  # long, right-padded with pad id
    attention_mask: torch.Tensor  # 1 = real token
    loss_mask: torch.Tensor  # 1 = policy-sampled token
    old_logprobs: torch.Tensor  # float, 0 where loss_mask == 0
    advantages: torch.Tensor  # float, 0 where loss_mask == 0
    returns: torch.Tensor | None = None  # float, the critic's regression targets (gae)
    old_values: torch.Tensor | None = None  # float, the critic's values before the update (gae)
    # rollout.action_logprob=renormalised: per row, its constrained replies as (token offset,
    # the candidates' ids); the trainer's log-probs are then the renormalised ones
    # (agentgym.training.action_logprob). None: every log-prob is the policy's own.
    choices: list[RowChoices] | None = None

    OPTIONAL = ("returns", "old_values")

    @classmethod
    def from_rows(cls, rows: list[dict], pad_id: int) -> "TrainBatch":
        """``rows``: dicts with input_ids, loss_mask, old_logprobs, advantages (equal lengths),
        and optionally returns / old_values (all rows or none) and action_starts /
        action_candidates (a row without them, or with None, has no constrained reply)."""
        if not rows:
            raise ValueError("TrainBatch.from_rows: no rows")
        width = max(len(r["input_ids"]) for r in rows)
        b = len(rows)
        ids = torch.full((b, width), pad_id, dtype=torch.long)
        attn = torch.zeros((b, width), dtype=torch.long)
        cols = ["loss_mask", "old_logprobs", "advantages"]
        for name in cls.OPTIONAL:
            have = sum(r.get(name) is not None for r in rows)
            if have not in (0, b):
                raise ValueError(f"TrainBatch.from_rows: {have} of {b} rows have {name}; give it for all rows or none")
            if have:
                cols.append(name)
        floats = {c: torch.zeros((b, width), dtype=torch.float32) for c in cols}
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            if any(len(r[c]) != n for c in cols):
                raise ValueError(f"row {i}: token columns differ in length")
            ids[i, :n] = torch.as_tensor(r["input_ids"], dtype=torch.long)
            attn[i, :n] = 1
            for c in cols:
                floats[c][i, :n] = torch.as_tensor(r[c], dtype=torch.float32)
        choices = None
        if any(r.get("action_starts") is not None for r in rows):
            choices = [[(int(s), [list(c) for c in cands])
                        for s, cands in zip(r.get("action_starts") or [], r.get("action_candidates") or [])]
                       for r in rows]
        return cls(ids, attn, **floats, choices=choices)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The batch's tensors by field name (optional fields only when set)."""
        out = {k: getattr(self, k) for k in ("input_ids", "attention_mask", "loss_mask", "old_logprobs", "advantages")}
        out.update({k: getattr(self, k) for k in self.OPTIONAL if getattr(self, k) is not None})
        return out

    def select(self, idx: torch.Tensor | list[int]) -> "TrainBatch":
        idx = torch.as_tensor(idx, dtype=torch.long)
        choices = None if self.choices is None else [self.choices[i] for i in idx.tolist()]
        return TrainBatch(**{k: t[idx] for k, t in self.tensors().items()}, choices=choices)

    def to(self, device: torch.device | str) -> "TrainBatch":
        return TrainBatch(**{k: t.to(device) for k, t in self.tensors().items()}, choices=self.choices)

    def trimmed(self) -> "TrainBatch":
        """The batch without the columns that are padding in every row (rows are right-padded to
        the widest row of the whole batch; a micro-batch of shorter rows need not compute them)."""
        width = int(self.attention_mask.sum(-1).max()) if len(self) else 0
        if width == self.input_ids.shape[1]:
            return self
        return TrainBatch(**{k: t[:, :width] for k, t in self.tensors().items()}, choices=self.choices)
