"""One iteration's episodes as one column-oriented batch (``EpisodeBatch``): the type that crosses
the advantage step, the store and the trainer.

verl's ``DataProto`` is the model: one batch that each step adds columns to, instead of a new
representation per step. Rows are episodes in the **episode layout**: the whole conversation's
token ids, with every per-token column (``TOKEN_COLUMNS``) aligned with ``input_ids``. Mask
meaning as in ``agentgym.types``: ``loss_mask`` 1 = a token the policy sampled.

An iteration, through this type (``agentgym.pipeline.PolicySession``):

1. the rollout's ``Episode`` records are committed to the store (episodes and turns tables);
2. the advantage step reads them back as ``EpisodeBatch.from_episodes`` and adds ``advantages``
   and ``returns`` (``with_columns``), committed as the advantages table;
3. the update adds ``old_values`` (critic), keeps the rows that carry a signal (``select``: a row
   mask) and commits exactly that batch as the train_batch table (``write_train_batch``);
4. the trainer (each rank of a group too) reads it back (``read_train_batch``), cuts rows into
   their context segments (``segments``) and pads them into tensors (``padded`` -> ``TrainBatch``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import torch

from agentgym.context import split_rows

if TYPE_CHECKING:
    from agentgym.training.batch import TrainBatch
    from agentgym.types import Episode

#: per-token columns: one value per token of ``input_ids``
TOKEN_COLUMNS = ("input_ids", "loss_mask", "old_logprobs", "advantages", "returns", "old_values")
#: every batch has these
REQUIRED = ("episode_id", "input_ids", "loss_mask", "old_logprobs")
#: per-row columns besides the token columns (``action_*``: rollout.action_logprob=renormalised's
#: constrained replies, ``Episode.action_starts`` / ``action_candidates``; None in a row: none)
ROW_COLUMNS = ("episode_id", "group_id", "context_starts", "action_starts", "action_candidates")
COLUMNS = tuple(dict.fromkeys(REQUIRED + ROW_COLUMNS + TOKEN_COLUMNS))


@dataclass(frozen=True)
class EpisodeBatch:
    """Columns by name, each a list with one value per row (episode); validated on construction.

    Optional columns (``group_id``, ``context_starts``, ``advantages``, ``returns``,
    ``old_values``, ``action_starts``, ``action_candidates``) are present for every row or absent.
    """

    columns: Mapping[str, list] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = [c for c in REQUIRED if c not in self.columns]
        if missing:
            raise ValueError(f"EpisodeBatch: missing columns {missing}; every batch has {list(REQUIRED)}")
        unknown = sorted(set(self.columns) - set(COLUMNS))
        if unknown:
            raise ValueError(f"EpisodeBatch: unknown columns {unknown}; known: {list(COLUMNS)}")
        ids = self.columns["episode_id"]
        for name, col in self.columns.items():
            if len(col) != len(ids):
                raise ValueError(f"EpisodeBatch: column {name!r} has {len(col)} rows, episode_id has {len(ids)}")
        widths = [len(x) for x in self.columns["input_ids"]]
        for name in TOKEN_COLUMNS[1:]:
            for i, (value, width) in enumerate(zip(self.columns.get(name, ()), widths)):
                if value is None or len(value) != width:
                    got = "None" if value is None else f"{len(value)} values"
                    raise ValueError(f"EpisodeBatch row {i} ({ids[i]}): {name} has {got} for {width} tokens")

    # -- building
    @classmethod
    def from_episodes(cls, episodes: Iterable[Episode]) -> EpisodeBatch:
        """The episodes' token columns, ids, groups and context segments, in the given order."""
        eps = list(episodes)
        columns: dict[str, list] = {
            "episode_id": [e.episode_id for e in eps], "group_id": [e.group_id for e in eps],
            "input_ids": [list(e.input_ids) for e in eps], "loss_mask": [list(e.loss_mask) for e in eps],
            "old_logprobs": [list(e.old_logprobs) for e in eps],
            "context_starts": [list(e.context_starts) for e in eps],
        }
        if any(e.action_starts is not None for e in eps):  # rollout.action_logprob=renormalised
            columns["action_starts"] = [e.action_starts for e in eps]
            columns["action_candidates"] = [e.action_candidates for e in eps]
        return cls(columns)

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]]) -> EpisodeBatch:
        """Rows (dicts with the batch's columns; an optional column left out or ``None`` in every
        row is absent) as a batch."""
        names = [c for c in COLUMNS if any(r.get(c) is not None for r in rows)] if rows else list(REQUIRED)
        return cls({c: [r.get(c) for r in rows] for c in names})

    def with_columns(self, **columns: Sequence[Any] | torch.Tensor) -> EpisodeBatch:
        """This batch plus (or with replaced) columns. A token column may be given as a padded
        ``(B, T)`` tensor: each row keeps its first ``len(input_ids)`` values."""
        widths = [len(x) for x in self.columns["input_ids"]]
        added: dict[str, list] = {}
        for name, col in columns.items():
            if isinstance(col, torch.Tensor) and name in TOKEN_COLUMNS:
                added[name] = [col[i, :w].tolist() for i, w in enumerate(widths)]
            else:
                added[name] = list(col)
        return EpisodeBatch({**self.columns, **added})

    def without(self, *names: str) -> EpisodeBatch:
        return EpisodeBatch({k: v for k, v in self.columns.items() if k not in names})

    def select(self, keep: Sequence[bool]) -> EpisodeBatch:
        """The rows where ``keep`` is true (a row mask, one flag per row), in order."""
        if len(keep) != len(self):
            raise ValueError(f"EpisodeBatch.select: {len(keep)} flags for {len(self)} rows")
        return EpisodeBatch({k: [v for v, m in zip(col, keep) if m] for k, col in self.columns.items()})

    # -- reading
    def __len__(self) -> int:
        return len(self.columns["episode_id"])

    def __getitem__(self, name: str) -> list:
        return self.columns[name]

    def __contains__(self, name: object) -> bool:
        return name in self.columns

    def rows(self) -> list[dict[str, Any]]:
        """One dict per row (what ``split_rows`` and ``TrainBatch.from_rows`` take)."""
        names = list(self.columns)
        return [dict(zip(names, values)) for values in zip(*(self.columns[n] for n in names))]

    def segments(self) -> tuple[EpisodeBatch, list[tuple[int, int, int]]]:
        """One row per context segment (``agentgym.context``): what the policy saw when it sampled.
        Also returns, per segment row, ``(row, start, end)`` in this batch's layout."""
        if not any(self.columns.get("context_starts") or ()):
            return self.without("context_starts"), [(i, 0, len(x)) for i, x in enumerate(self["input_ids"])]
        rows, spans = split_rows(self.rows())
        return EpisodeBatch.from_rows(rows), spans

    def padded(self, pad_id: int) -> TrainBatch:
        """Right-padded tensors for the trainer (``advantages`` 0 when the batch has none yet)."""
        from agentgym.training.batch import TrainBatch

        rows = self.rows()
        if "advantages" not in self:
            rows = [{**r, "advantages": [0.0] * len(r["input_ids"])} for r in rows]
        return TrainBatch.from_rows(rows, pad_id)


__all__ = ["COLUMNS", "REQUIRED", "TOKEN_COLUMNS", "EpisodeBatch"]
