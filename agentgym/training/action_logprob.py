"""The log-prob of a constrained reply under the distribution it was drawn from
(``rollout.action_logprob: renormalised``).

With ``rollout.constrain_actions`` a reply is drawn among the turn's valid actions ``C(s)``
(their reply ids, ``ChatFormatter.action_reply_ids``) with probability
``q(a|s) = pi(a|s) / Z(s)``, ``Z(s) = sum_{c in C(s)} pi(c|s)``. The default rule
(``policy``) stores and recomputes ``log pi`` of each of the reply's tokens, so the PPO ratio
and its gradient leave out ``log Z``, which moves with the weights too (it is exact only when
all of a group's turns share a state and Z cancels). ``renormalised`` trains on ``log q``.

**Spreading ``log q(a|s)`` over the reply's tokens.** The token-level ratio and clip need one
log-prob per token whose sum over the reply is ``log q(a|s)``. This module uses the factorisation
of ``q`` along the candidates' token tree (trie): token ``j`` of the reply gets

    log q_j = log pi(a_j | s, a_<j) + log Z_{j+1} - log Z_j,
    Z_j     = sum over candidates c with c[:j] = a[:j] of pi(c[j:] | s, c[:j]),

the share of the candidate mass through ``a[:j]`` that continues with ``a_j`` (``Z_0 = Z(s)``;
``Z_n`` for the whole reply ``a`` of length ``n`` counts the candidates equal to ``a``, 1 unless
the list repeats it). Each ``q_j`` is a proper conditional probability of the renormalised
policy, and the sum telescopes to ``log pi(a|s) - log Z(s)``. So a token every candidate
through that node shares (" go" when all actions start "go to ...") has ``q_j = 1`` under
every weight: ratio exactly 1, no gradient, never clipped; the ratio of a token where
candidates part ways measures how the renormalised policy's choice there moved, and the clip
bounds that choice's change, as token-level PPO does for free text. (Subtracting ``log Z`` on
the reply's first token instead would give the same sum and the same on-policy gradient, but
its first token's ratio would mix the whole action's normaliser into one token's clip.)

**Where the trainer computes it** (``candidate_plan`` + ``CandidatePlan.renormalise``): in the
same forward as the conversation. The candidates of every turn that are not the chosen reply are
appended to the row as a token tree (each distinct prefix once) with a 4-D attention mask: a
tree node sees the conversation up to the turn's reply **grafted at its longest common prefix
with the chosen reply** (those tokens are in the row already) and its own tree ancestors, at
position ids by depth. One forward then gives every candidate token's log-prob; the gradient
flows through the normaliser into the shared prefix like any other token's. The chosen reply's
tokens come from the conversation itself (no duplicate), so a turn with a single candidate gets
``log q_j = 0`` exactly. Cost: the tree's nodes (the distinct candidate prefixes not on the
chosen reply) as extra tokens of the forward and backward, and the LM head on each of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from agentgym.types import reply_end

#: the two rules of ``rollout.action_logprob``
POLICY = "policy"
RENORMALISED = "renormalised"

#: one row's constrained turns: (token offset of the reply in the row, the candidates' ids)
RowChoices = list[tuple[int, list[list[int]]]]


def renormalised_logprobs(candidates: Sequence[Sequence[int]], logprobs: Sequence[Tensor] | Tensor,
                          chosen: int, temperature: float = 1.0) -> Tensor:
    """Per token of ``candidates[chosen]`` (length n), ``log q_j`` (module docstring): the
    candidates' token trie's conditional log-probs, summing to ``log pi(a) - log Z``.

    ``temperature`` t (``rollout.action_temperature``): those of the tempered choice
    ``q_t(a) = pi(a)^(1/t) / sum_c pi(c)^(1/t)`` instead, summing to ``log pi(a)/t - log Z_t``.
    The same trie factorisation with every token's ``log pi`` divided by t: a candidate's mass
    through a node is ``exp(log pi(c)/t)``, whose shared-prefix factor cancels in ``Z_{j+1}/Z_j``
    as at t = 1.

    ``logprobs[i]`` holds ``log pi`` of each token of ``candidates[i]`` given the prompt and the
    candidate's earlier tokens: a list of 1-D tensors, or one (C, longest) tensor padded with
    zeros. Differentiable in ``logprobs``; float64 in, float64 out (the sampler's floats) or
    float32 (the trainer's)."""
    a = tuple(candidates[chosen])
    n = len(a)
    member = torch.zeros((len(candidates), n), dtype=torch.bool)  # c[:j] == a[:j], j = 0 .. n-1
    equal = 0
    for i, c in enumerate(candidates):
        c = tuple(c)
        member[i, : min(common_prefix(c, a) + 1, n)] = True
        equal += int(c == a)
    lp = logprobs if isinstance(logprobs, Tensor) else \
        torch.nn.utils.rnn.pad_sequence(list(logprobs), batch_first=True)
    if temperature != 1.0:
        lp = lp / temperature
    # suffix sums S_c(j) = sum_{i >= j} lp_c[i] = log pi(c[j:] | s, c[:j]) (0 past the end)
    suffix = lp.flip(1).cumsum(1).flip(1)[:, :n]
    log_z = torch.logsumexp(suffix.masked_fill(~member.to(lp.device), float("-inf")), dim=0)  # Z_0 .. Z_{n-1}
    last = lp.new_full((1,), math.log(equal))  # Z_n: the copies of a in the list
    return lp[chosen, :n] + torch.cat([log_z[1:], last]) - log_z


def common_prefix(c: Sequence[int], a: Sequence[int]) -> int:
    """How many leading tokens ``c`` and ``a`` share."""
    common = 0
    while common < min(len(c), len(a)) and c[common] == a[common]:
        common += 1
    return common


def choice_index(reply: Sequence[int], candidates: Sequence[Sequence[int]]) -> int:
    """The first candidate equal to ``reply``; ValueError when none is."""
    reply = list(reply)
    for i, c in enumerate(candidates):
        if list(c) == reply:
            return i
    raise ValueError(f"the reply {reply} is none of its {len(candidates)} candidates")


@dataclass
class CandidatePlan:
    """How one padded batch's constrained turns are scored in the trainer's forward
    (``candidate_plan``): the tree tokens appended to every row and where each candidate token's
    log-prob is read."""

    input_ids: Tensor  # (B, W + L) the rows, then each row's tree nodes (pad id where none)
    position_ids: Tensor  # (B, W + L)
    allowed: Tensor  # (B, W + L, W + L) bool: query position -> key positions it attends to
    width: int  # W, the conversation part
    node_rows: Tensor  # (N,) row and column (>= W) of each real tree node, in head order
    node_cols: Tensor
    extra_rows: Tensor  # (E,) row and position of conversation positions whose next-token
    extra_cols: Tensor  # log-probs a candidate extending the chosen reply needs (not targets)
    # each candidate token's log-prob: from the conversation's target rows (``main``: index into
    # the targets in row-major order) or the extra head rows (tree nodes, then extra positions)
    main_index: Tensor
    main_token: Tensor
    extra_index: Tensor
    extra_token: Tensor
    order: Tensor  # cat(main values, extra values, 0)[order]: every candidate token, turn by turn, then 0
    matrices: list[Tensor]  # per turn, (candidates, longest): each candidate's tokens' indices into
    # the ordered values, padded with the trailing 0's (``renormalised_logprobs``' zero padding)
    # per turn: (row, start of the reply, the candidates, the chosen one, offset of each
    # candidate's first token in the ordered values)
    turns: list[tuple[int, int, list[list[int]], int, list[int]]]

    def attention_mask(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The additive 4-D mask (B, 1, W + L, W + L) the model takes (0 allowed, min masked)."""
        mask = torch.zeros(self.allowed.shape, dtype=dtype, device=device)
        mask.masked_fill_(~self.allowed.to(device), torch.finfo(dtype).min)
        return mask[:, None]

    def renormalise(self, token_lp: Tensor, main_logp: Tensor, extra_logp: Tensor,
                    temperature: float = 1.0) -> Tensor:
        """``token_lp`` (B, T; the conversation's per-token log-probs) with each constrained
        reply's tokens replaced by ``renormalised_logprobs`` at choice temperature ``temperature``. ``main_logp``: log-softmax rows of
        the conversation's target positions (row-major, as ``policy_forward`` computes them);
        ``extra_logp``: those of the tree nodes then the extra positions."""
        values = torch.cat([main_logp[self.main_index, self.main_token],
                            extra_logp[self.extra_index, self.extra_token], main_logp.new_zeros(1)])[self.order]
        rows: list[int] = []
        cols: list[int] = []
        new: list[Tensor] = []
        for (r, start, cands, k, _), matrix in zip(self.turns, self.matrices):
            q = renormalised_logprobs(cands, values[matrix.to(values.device)], k, temperature)
            rows += [r] * len(q)
            cols += range(start, start + len(q))
            new.append(q)
        if not new:
            return token_lp
        idx = (torch.tensor(rows, device=token_lp.device), torch.tensor(cols, device=token_lp.device))
        return token_lp.index_put(idx, torch.cat(new).to(token_lp.dtype))


def candidate_plan(input_ids: Tensor, attention_mask: Tensor, loss_mask: Tensor,
                   choices: Sequence[RowChoices | None], pad_id: int = 0) -> CandidatePlan:
    """The tree layout (``CandidatePlan``) of a padded batch's constrained turns. ``choices[r]``:
    row ``r``'s (reply offset, candidates) pairs; the reply (the run of ``loss_mask`` 1 from the
    offset) must be one of its candidates, which ``Episode.validate`` checks at the store."""
    ids_cpu = input_ids.detach().cpu()
    attn = attention_mask.detach().cpu().bool()
    mask_cpu = loss_mask.detach().cpu()
    target = mask_cpu[:, 1:].bool()
    b, w = ids_cpu.shape
    main_row = torch.full((b, w), -1, dtype=torch.long)  # target row of each token position
    main_row[:, 1:][target] = torch.arange(int(target.sum()))
    # per row, its tree nodes: (token, position, graft: conversation keys it sees, ancestors + itself)
    nodes: list[list[tuple[int, int, int, list[int]]]] = [[] for _ in range(b)]
    extra_pos: dict[tuple[int, int], int] = {}  # conversation positions needing the head -> index
    main_idx: list[int] = []
    main_tok: list[int] = []
    extra_ref: list[tuple[bool, int, int, int]] = []  # (a node?, row, node or extra index, token)
    kinds: list[tuple[int, int]] = []  # per candidate token: (0 main / 1 extra, index in that list)
    turns = []
    for r, row in enumerate(choices):
        for start, cands in row or []:
            cands = [list(c) for c in cands]
            a = ids_cpu[r, start:reply_end(mask_cpu[r].tolist(), start)].tolist()
            try:
                k = choice_index(a, cands)
            except ValueError:
                raise ValueError(f"row {r}: the sampled reply at token {start} is none of its "
                                 f"{len(cands)} candidates") from None
            n = len(a)
            index: dict[tuple[int, ...], int] = {}  # tree node of each prefix off the chosen reply
            offsets = []
            for c in cands:
                offsets.append(len(kinds))
                common = common_prefix(c, a)
                for d in range(common + 1, len(c)):  # the prefixes c[:d] off the chosen reply
                    key = tuple(c[:d])
                    if key not in index:
                        parent = index[tuple(c[:d - 1])] if d - 1 > common else None
                        ancestors = ([] if parent is None else nodes[r][parent][3]) + [len(nodes[r])]
                        index[key] = len(nodes[r])
                        nodes[r].append((c[d - 1], start + d - 1, start + common, ancestors))
                for j in range(len(c)):
                    if j <= common and j < n:  # the conversation's own logits at start + j - 1
                        kinds.append((0, len(main_idx)))
                        main_idx.append(int(main_row[r, start + j]))
                        main_tok.append(c[j])
                        continue
                    kinds.append((1, len(extra_ref)))
                    if j > common:  # the tree node of c[:j]
                        extra_ref.append((True, r, index[tuple(c[:j])], c[j]))
                    else:  # j == common == n: c extends the chosen reply, the logits after its end
                        e = extra_pos.setdefault((r, start + n - 1), len(extra_pos))
                        extra_ref.append((False, r, e, c[j]))
            turns.append((r, start, cands, k, offsets))
    L = max((len(x) for x in nodes), default=0)
    ids = torch.cat([ids_cpu, torch.full((b, L), pad_id, dtype=torch.long)], dim=1)
    pos = torch.cat([torch.arange(w).expand(b, w), torch.zeros((b, L), dtype=torch.long)], dim=1)
    allowed = torch.zeros((b, w + L, w + L), dtype=torch.bool)
    allowed[:, :w, :w] = torch.ones((w, w), dtype=torch.bool).tril() & attn[:, None, :]
    allowed[:, torch.arange(w, w + L), torch.arange(w, w + L)] = True  # every tree slot (pads too) sees itself
    node_base: list[int] = []  # head row of each row's first node
    count = 0
    for r in range(b):
        node_base.append(count)
        count += len(nodes[r])
        for i, (tok, p, graft, ancestors) in enumerate(nodes[r]):
            ids[r, w + i] = tok
            pos[r, w + i] = p
            allowed[r, w + i, :graft] = True
            allowed[r, w + i, [w + x for x in ancestors]] = True
    extra_idx = [node_base[r] + i if is_node else count + i for is_node, r, i, _ in extra_ref]
    order = [i if kind == 0 else len(main_idx) + i for kind, i in kinds] + [len(main_idx) + len(extra_ref)]
    matrices = []
    for _, _, cands, _, offsets in turns:
        width = max(len(c) for c in cands)
        matrices.append(torch.tensor([list(range(o, o + len(c))) + [len(kinds)] * (width - len(c))
                                      for o, c in zip(offsets, cands)], dtype=torch.long))
    device = input_ids.device

    def t(x: list[int]) -> Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    return CandidatePlan(
        input_ids=ids.to(device), position_ids=pos.to(device), allowed=allowed, width=w,
        node_rows=t([r for r in range(b) for _ in nodes[r]]),
        node_cols=t([w + i for r in range(b) for i in range(len(nodes[r]))]),
        extra_rows=t([r for r, _ in extra_pos]), extra_cols=t([p for _, p in extra_pos]),
        main_index=t(main_idx), main_token=t(main_tok), extra_index=t(extra_idx),
        extra_token=t([tok for *_, tok in extra_ref]), order=t(order), matrices=matrices,
        turns=turns)


__all__ = ["POLICY", "RENORMALISED", "CandidatePlan", "RowChoices", "candidate_plan", "choice_index",
           "common_prefix", "renormalised_logprobs", "reply_end"]
