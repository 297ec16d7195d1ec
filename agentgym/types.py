"""The records that cross component boundaries: one episode, one turn.

``Episode`` is the unit the rollout produces, the store writes (``episodes`` table), and the
trainer consumes. Its token columns are the *exact* ids the engine saw and sampled:

* ``input_ids``   the whole conversation (prompt, replies, observations, template glue); with a
                  context policy that drops old turns, the concatenation of the contexts the
                  policy saw (segments starting at ``context_starts``; see agentgym.context)
* ``loss_mask``   1 where the token was sampled by the policy, 0 elsewhere (prompt,
                  observations, forced response prefixes, template glue)
* ``old_logprobs`` the engine's log-prob of each sampled token under the sampling
                  distribution (logits / temperature); 0.0 where ``loss_mask`` is 0. With
                  ``rollout.action_logprob: renormalised`` a constrained reply's log-probs are
                  renormalised over its candidates (``agentgym.training.action_logprob``), which
                  ``action_starts`` / ``action_candidates`` record for the trainer
"""

from __future__ import annotations

import math

from collections.abc import Sequence
from dataclasses import dataclass, field


def segment_bounds(n_tokens: int, starts: list[int] | None) -> list[tuple[int, int]]:
    """``[start, end)`` of each context segment of an episode of ``n_tokens`` tokens whose later
    segments begin at ``starts`` (empty or None: one segment); ValueError unless ``starts``
    increase strictly within (0, n_tokens)."""
    if not starts:
        return [(0, n_tokens)]
    edges = [0, *starts, n_tokens]
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"context_starts {starts} must increase strictly within (0, {n_tokens})")
    return list(zip(edges, edges[1:]))


@dataclass
class Turn:
    turn: int
    observation: str  # what the agent saw before acting
    action_text: str  # the reply as text (response prefix + decoded sampled tokens)
    parsed_action: str | None
    reward: float
    terminated: bool
    truncated: bool
    format_error: bool
    gen_tokens: int
    env_latency_ms: float
    # a well-formed reply naming no available action (the adapter's info["invalid_action"])
    invalid_action: bool = False
    # the environment state the agent acted in: the adapter's info["state_key"] that came with
    # the observation, else a digest of the observation text (GiGPO's step groups compare turns
    # taken from equal states)
    state_key: str = ""


def reply_end(loss_mask: Sequence[int], start: int) -> int:
    """End (exclusive) of the run of sampled tokens (``loss_mask`` 1) that starts at ``start``: the reply."""
    end = start
    while end < len(loss_mask) and loss_mask[end]:
        end += 1
    return end


@dataclass
class Episode:
    episode_id: str
    group_id: str
    env: str
    task_id: int
    seed: int
    horizon: int
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    old_logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0
    success: bool = False
    terminated: bool = False
    truncated: bool = False
    infra_error: bool = False
    error: str | None = None
    # token offsets where the policy's context restarted (rollout.context_policy window/summary):
    # each later segment is a new prompt the engine saw, copied ids then the reply sampled under
    # it (agentgym.context); empty: one continuous conversation
    context_starts: list[int] = field(default_factory=list)
    # rollout.action_logprob=renormalised: the token offset of each constrained reply (drawn among
    # the turn's valid actions) and those candidates' reply ids, which the trainer needs to
    # recompute the normaliser; None: not recorded (the policy rule, or free replies only)
    action_starts: list[int] | None = None
    action_candidates: list[list[list[int]]] | None = None

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    def append(self, ids: list[int], *, sampled: bool, logprobs: list[float] | None = None) -> None:
        """Append tokens; ``sampled`` tokens must come with their engine log-probs."""
        if sampled:
            if logprobs is None or len(logprobs) != len(ids):
                raise ValueError("sampled tokens need one log-prob each")
            self.old_logprobs.extend(float(x) for x in logprobs)
        else:
            self.old_logprobs.extend([0.0] * len(ids))
        self.input_ids.extend(int(t) for t in ids)
        self.loss_mask.extend([1 if sampled else 0] * len(ids))

    def record_choice(self, candidates: list[list[int]]) -> None:
        """The reply appended next is drawn among ``candidates`` (its offset: the current end)."""
        if self.action_starts is None or self.action_candidates is None:
            self.action_starts, self.action_candidates = [], []
        self.action_starts.append(len(self.input_ids))
        self.action_candidates.append([list(c) for c in candidates])

    def validate(self, tokens: bool = True) -> None:
        """Raise ValueError naming the episode if it is inconsistent. ``tokens=False`` skips the
        per-token check (a masked token's log-prob is 0), for a caller that runs it vectorised
        over many episodes at once (the trajectory store's writer)."""
        n = len(self.input_ids)
        if not (len(self.loss_mask) == len(self.old_logprobs) == n):
            raise ValueError(f"episode {self.episode_id}: token columns differ in length")
        if tokens and any(lp != 0.0 for lp, m in zip(self.old_logprobs, self.loss_mask) if m == 0):
            raise ValueError(f"episode {self.episode_id}: log-prob on a masked token")
        try:
            segment_bounds(n, self.context_starts)
        except ValueError as e:
            raise ValueError(f"episode {self.episode_id}: {e}") from None
        self._validate_choices()
        if self.infra_error:
            if not math.isnan(self.reward):
                raise ValueError(f"episode {self.episode_id}: an infra_error episode is not scored "
                                 f"(reward NaN), got {self.reward}")
        elif not 0.0 <= self.reward <= 1.0:
            raise ValueError(f"episode {self.episode_id}: reward {self.reward} outside [0, 1]")

    def _validate_choices(self) -> None:
        """Each recorded reply (the run of sampled tokens at its offset) is one of its candidates."""
        starts, cands = self.action_starts, self.action_candidates
        if starts is None and cands is None:
            return
        if starts is None or cands is None or len(starts) != len(cands):
            raise ValueError(f"episode {self.episode_id}: action_starts and action_candidates differ "
                             "(give both, one entry per constrained reply, or neither)")
        last = 0
        for s, cs in zip(starts, cands):
            if not last < s < len(self.input_ids):
                raise ValueError(f"episode {self.episode_id}: action_starts {starts} must increase "
                                 f"strictly within (0, {len(self.input_ids)})")
            end = reply_end(self.loss_mask, s)
            if list(self.input_ids[s:end]) not in [list(c) for c in cs]:
                raise ValueError(f"episode {self.episode_id}: the reply at token {s} is none of its "
                                 f"{len(cs)} candidates")
            last = s
