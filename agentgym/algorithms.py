"""RL math for multi-turn agent training, as pure torch functions (in the style of verl's
``trainer/ppo/core_algos.py``).

Layout used everywhere in this module
-------------------------------------
* Token tensors are ``(B, T)`` and cover the WHOLE multi-turn conversation of each episode:
  the prompt, the policy's replies and the environment's observations, interleaved, then
  right padding.
* ``loss_mask`` ``(B, T)`` (bool, int or float 0/1) is 1 at tokens SAMPLED BY THE POLICY and
  0 everywhere else (prompt, environment observations, padding). "Policy tokens" below means
  positions where ``loss_mask == 1``; "masked tokens" means the others.
* ``token_rewards`` ``(B, T)`` float. Rewards are normally non-zero only at policy tokens (use
  :func:`place_outcome_reward` / :func:`place_rewards_on_turn_ends` to put them there). The sequence
  estimators (REINFORCE++, GAE) credit a reward found at a masked token to the nearest
  PRECEDING policy token (the action that caused it), undiscounted; a reward before the first
  policy token of a row has no action to credit and is ignored by them.  GRPO/RLOO use the
  row sum of ``token_rewards``.
* Every advantage/return tensor returned here is exactly 0 at masked tokens, and values found at
  masked positions of any input other than ``token_rewards`` never change results at policy
  tokens.

Group ids (GRPO/RLOO): one id per row; rows sharing an id are episodes of the same task and form
the baseline group. A list of str/int or a 1-D tensor is accepted and mapped to contiguous ints.

Conventions (documented where used)
-----------------------------------
* Group std (GRPO) and whitening variance are UNBIASED (Bessel-corrected, ``torch.std``'s default),
  as in verl. A group of size 1 gets advantage 0 (no baseline is possible; verl instead leaves the
  raw score, which is a biased signal). A group whose rewards are all equal gets exactly 0.
* ``seq-mean-token-sum-norm`` follows verl: ``sum(loss * mask) / T`` where ``T`` is the tensor's
  last dimension (or the constant ``norm_length`` if given; Dr. GRPO wants a constant).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

from agentgym.config import Estimator

__all__ = [
    "place_outcome_reward",
    "grpo_advantages",
    "rloo_advantages",
    "reinforce_pp_advantages",
    "gae_advantages",
    "turn_level_returns",
    "turn_index",
    "broadcast_turns",
    "turn_sums",
    "place_rewards_on_turn_ends",
    "turn_credit_advantages",
    "compute_advantages",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "kl_penalty",
    "entropy_from_logits",
    "entropy_from_logprobs",
    "aggregate_loss",
    "policy_loss",
    "value_loss",
    "tied_groups",
    "group_index",
    "explained_variance",
    "LOSS_AGG_MODES",
    "KL_ESTIMATORS",
    "TURN_BASELINES",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3", "kl", "mse", "low_var_kl", "abs")


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _float_dtype(x: Tensor) -> torch.dtype:
    return x.dtype if x.is_floating_point() else torch.get_default_dtype()


def _check_2d(name: str, x: Tensor, like: Tensor | None = None) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be (B, T); got shape {tuple(x.shape)}")
    if like is not None and x.shape != like.shape:
        raise ValueError(
            f"{name} has shape {tuple(x.shape)} but loss_mask has {tuple(like.shape)}; "
            "all token tensors must cover the same (B, T) conversation layout"
        )


def _bool_mask(loss_mask: Tensor) -> Tensor:
    return loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0


def _estimator(estimator: Estimator | str) -> Estimator:
    """``estimator`` as an :class:`Estimator` (case-insensitive); a clear error otherwise."""
    try:
        if isinstance(estimator, str) and not isinstance(estimator, Estimator):
            estimator = estimator.lower()
        return Estimator(estimator)
    except ValueError:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; use one of {[e.value for e in Estimator]}"
        ) from None


def group_index(group_ids: Any, batch_size: int, device: torch.device | None = None) -> tuple[Tensor, int]:
    """Map ``group_ids`` (list of str/int, numpy array or 1-D tensor, length B) to a LongTensor
    ``(B,)`` of contiguous ints ``0..G-1`` (in order of first appearance for lists, sorted for
    tensors) and return it with ``G``."""
    if isinstance(group_ids, Tensor):
        if group_ids.dim() != 1 or group_ids.shape[0] != batch_size:
            raise ValueError(
                f"group_ids must be 1-D with one id per row (B={batch_size}); got shape {tuple(group_ids.shape)}"
            )
        _, inv = torch.unique(group_ids, return_inverse=True)
        inv = inv.to(device=device if device is not None else group_ids.device, dtype=torch.long)
        return inv, int(inv.max().item()) + 1 if batch_size else 0
    ids = list(group_ids)
    if len(ids) != batch_size:
        raise ValueError(f"group_ids has {len(ids)} entries but the batch has B={batch_size} rows; give one id per row")
    table: dict[Any, int] = {}
    out = []
    for g in ids:
        key = g.item() if hasattr(g, "item") and not isinstance(g, (str, bytes)) else g
        out.append(table.setdefault(key, len(table)))
    return torch.tensor(out, dtype=torch.long, device=device), len(table)


def _group_stats(scores: Tensor, idx: Tensor, n_groups: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-row (count, sum, unbiased std, tied) of the row's group; all ``(B,)``."""
    dtype = scores.dtype
    counts = torch.bincount(idx, minlength=n_groups).to(dtype)
    sums = torch.zeros(n_groups, dtype=dtype, device=scores.device).index_add_(0, idx, scores)
    mean = sums / counts.clamp_min(1)
    dev = scores - mean[idx]
    sq = torch.zeros(n_groups, dtype=dtype, device=scores.device).index_add_(0, idx, dev * dev)
    std = torch.sqrt(sq / (counts - 1).clamp_min(1))
    gmax = torch.full((n_groups,), -math.inf, dtype=dtype, device=scores.device).scatter_reduce(
        0, idx, scores, reduce="amax"
    )
    gmin = torch.full((n_groups,), math.inf, dtype=dtype, device=scores.device).scatter_reduce(
        0, idx, scores, reduce="amin"
    )
    tied = gmax[idx] == gmin[idx]
    return counts[idx], sums[idx], std[idx], tied


def _fold_rewards_onto_policy_tokens(token_rewards: Tensor, mask: Tensor) -> Tensor:
    """Move each reward found at a masked token onto the nearest preceding policy token of its
    row (rewards at policy tokens stay put; rewards before the first policy token are dropped).
    ``token_rewards`` (B,T) float, ``mask`` (B,T) bool -> (B,T), zero at masked tokens."""
    B, T = token_rewards.shape
    pos = torch.arange(T, device=token_rewards.device).expand(B, T)
    prev = torch.where(mask, pos, torch.full_like(pos, -1)).cummax(dim=1).values
    src = torch.where(prev >= 0, token_rewards, torch.zeros_like(token_rewards))
    return torch.zeros_like(token_rewards).scatter_add_(1, prev.clamp_min(0), src)


def _masked_discounted_cumsum(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Reverse discounted sum over the positions where ``mask`` is True only (masked positions
    neither discount nor receive). ``rewards`` (B,N) must already be 0 at masked positions.
    Returns (B,N), 0 at masked positions. Loop over N, vectorised over B (as verl)."""
    B, N = rewards.shape
    out = torch.zeros_like(rewards)
    running = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    for t in range(N - 1, -1, -1):
        mt = mask[:, t]
        running = torch.where(mt, rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(mt, running, torch.zeros_like(running))
    return out


# --------------------------------------------------------------------------------------------
# reward placement
# --------------------------------------------------------------------------------------------


def place_outcome_reward(rewards: Tensor, loss_mask: Tensor) -> Tensor:
    """Put one scalar reward per episode on its LAST policy token.

    ``rewards`` (B,) float; ``loss_mask`` (B,T). Returns ``(B,T)`` (dtype of ``rewards`` if
    floating) with ``rewards[b]`` at the last position where ``loss_mask[b] == 1`` and 0
    elsewhere. Never lands on a masked token: the original AgentGym-RL put it on the last token
    of the row, which in a multi-turn episode can be an environment/padding token, and the
    reward then vanished under the mask. A row with no policy token gets all zeros.
    """
    _check_2d("loss_mask", loss_mask)
    B, T = loss_mask.shape
    rewards = torch.as_tensor(rewards, device=loss_mask.device)
    if rewards.shape != (B,):
        raise ValueError(f"rewards must be (B,) = ({B},); got {tuple(rewards.shape)}")
    dtype = _float_dtype(rewards)
    m = _bool_mask(loss_mask)
    out = torch.zeros(B, T, dtype=dtype, device=loss_mask.device)
    if T == 0:
        return out
    has = m.any(dim=1)
    last = (T - 1) - m.flip(dims=[1]).to(torch.uint8).argmax(dim=1)
    rows = torch.arange(B, device=loss_mask.device)
    out[rows[has], last[has]] = rewards.to(dtype)[has]
    return out


def tied_groups(rewards: Tensor, group_ids: Any) -> Tensor:
    """``rewards`` (B,), ``group_ids`` (B ids) -> ``(B,)`` bool, True for rows whose group's
    rewards are all exactly equal (no learning signal for group baselines; a group of size 1 is
    tied)."""
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be (B,); got {tuple(rewards.shape)} (sum token rewards over T first)")
    idx, G = group_index(group_ids, rewards.shape[0], rewards.device)
    return _group_stats(rewards.to(_float_dtype(rewards)), idx, G)[3]


def grpo_advantages(
    token_rewards: Tensor,
    loss_mask: Tensor,
    group_ids: Any,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """GRPO outcome advantages.

    ``token_rewards`` (B,T), ``loss_mask`` (B,T), ``group_ids`` (B ids). The outcome score of a
    row is ``R_b = token_rewards[b].sum()``. Within each group:
    ``A_b = (R_b - mean_g) / (std_g + eps)`` with the UNBIASED std (``torch.std`` default, as
    verl), or ``A_b = R_b - mean_g`` when ``norm_by_std=False`` (Dr. GRPO). A group of size 1 or
    whose scores are all equal gets exactly 0. ``A_b`` is broadcast over the row's policy tokens.

    Returns ``(advantages, returns)``, both (B,T) and 0 at masked tokens; ``returns`` is the raw
    score ``R_b`` broadcast over policy tokens.
    """
    _check_2d("loss_mask", loss_mask)
    _check_2d("token_rewards", token_rewards, loss_mask)
    m = _bool_mask(loss_mask)
    with torch.no_grad():
        dtype = _float_dtype(token_rewards)
        scores = token_rewards.to(dtype).sum(dim=1)
        idx, G = group_index(group_ids, scores.shape[0], scores.device)
        count, total, std, tied = _group_stats(scores, idx, G)
        adv = scores - total / count
        if norm_by_std:
            adv = adv / (std + eps)
        adv = torch.where(tied | (count < 2), torch.zeros_like(adv), adv)
        zeros = torch.zeros_like(token_rewards, dtype=dtype)
        advantages = torch.where(m, adv[:, None].expand_as(zeros), zeros)
        returns = torch.where(m, scores[:, None].expand_as(zeros), zeros)
    return advantages, returns


def rloo_advantages(token_rewards: Tensor, loss_mask: Tensor, group_ids: Any) -> tuple[Tensor, Tensor]:
    """RLOO (leave-one-out) outcome advantages.

    ``R_b = token_rewards[b].sum()``; ``A_b = R_b - mean_{j in group(b), j != b} R_j``
    (= ``n/(n-1) * (R_b - mean_g)``). Group of size 1 or tied group -> 0. Broadcast over the
    row's policy tokens. Returns ``(advantages, returns)`` (B,T), 0 at masked tokens;
    ``returns`` is ``R_b`` broadcast.
    """
    _check_2d("loss_mask", loss_mask)
    _check_2d("token_rewards", token_rewards, loss_mask)
    m = _bool_mask(loss_mask)
    with torch.no_grad():
        dtype = _float_dtype(token_rewards)
        scores = token_rewards.to(dtype).sum(dim=1)
        idx, G = group_index(group_ids, scores.shape[0], scores.device)
        count, total, _, tied = _group_stats(scores, idx, G)
        adv = scores - (total - scores) / (count - 1).clamp_min(1)
        adv = torch.where(tied | (count < 2), torch.zeros_like(adv), adv)
        zeros = torch.zeros_like(token_rewards, dtype=dtype)
        advantages = torch.where(m, adv[:, None].expand_as(zeros), zeros)
        returns = torch.where(m, scores[:, None].expand_as(zeros), zeros)
    return advantages, returns


def reinforce_pp_advantages(
    token_rewards: Tensor, loss_mask: Tensor, gamma: float = 1.0, eps: float = 1e-8
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ advantages.

    Discounted return-to-go over POLICY tokens only: walking a row backwards,
    ``G_t = r_t + gamma * G_next`` where ``G_next`` is the return at the next policy token of the
    row (0 after the last one); env/masked tokens neither discount nor receive (rewards found at
    them are first credited to the preceding policy token, see module doc). Advantages are the
    returns whitened over all policy tokens of the batch: ``(G - mean) * rsqrt(var + eps)`` with
    the unbiased variance (verl ``masked_whiten``).

    Returns ``(advantages, returns)`` (B,T), 0 at masked tokens; ``returns`` are the raw ``G``.
    """
    _check_2d("loss_mask", loss_mask)
    _check_2d("token_rewards", token_rewards, loss_mask)
    m = _bool_mask(loss_mask)
    with torch.no_grad():
        r = _fold_rewards_onto_policy_tokens(token_rewards.to(_float_dtype(token_rewards)), m)
        returns = _masked_discounted_cumsum(r, m, gamma)
        advantages = masked_whiten(returns, m, eps=eps)
    return advantages, returns


def gae_advantages(
    token_rewards: Tensor, values: Tensor, loss_mask: Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation over policy tokens only.

    ``values`` (B,T) are the critic's V at every position (only policy positions are read).
    With ``p_0 < p_1 < ... < p_{n-1}`` the policy tokens of a row:
    ``delta_k = r_{p_k} + gamma * V_{p_{k+1}} - V_{p_k}`` (``V_{p_n} = 0``) and
    ``A_k = delta_k + gamma * lam * A_{k+1}`` (``A_n = 0``): env tokens carry the running
    advantage and next value through unchanged (as verl's multi-turn GAE), rewards found at them
    are credited to the preceding policy token first. ``returns = advantages + values`` at policy
    tokens. Advantages are NOT whitened here (use :func:`masked_whiten`;
    :func:`compute_advantages` does it by default).

    Returns ``(advantages, returns)`` (B,T), 0 at masked tokens.
    """
    _check_2d("loss_mask", loss_mask)
    _check_2d("token_rewards", token_rewards, loss_mask)
    _check_2d("values", values, loss_mask)
    m = _bool_mask(loss_mask)
    with torch.no_grad():
        dtype = torch.promote_types(_float_dtype(token_rewards), _float_dtype(values))
        r = _fold_rewards_onto_policy_tokens(token_rewards.to(dtype), m)
        v = values.detach().to(dtype)
        B, T = r.shape
        adv = torch.zeros_like(r)
        next_v = torch.zeros(B, dtype=dtype, device=r.device)
        last = torch.zeros(B, dtype=dtype, device=r.device)
        for t in range(T - 1, -1, -1):
            mt = m[:, t]
            delta = r[:, t] + gamma * next_v - v[:, t]
            last = torch.where(mt, delta + gamma * lam * last, last)
            next_v = torch.where(mt, v[:, t], next_v)
            adv[:, t] = torch.where(mt, last, torch.zeros_like(last))
        returns = torch.where(m, adv + torch.where(m, v, torch.zeros_like(v)), torch.zeros_like(adv))
    return adv, returns


def turn_level_returns(turn_rewards: Tensor, turn_mask: Tensor, gamma: float) -> Tensor:
    """Per-turn discounted returns across turns.

    ``turn_rewards`` (B,K) reward of turn k of episode b; ``turn_mask`` (B,K) 1 for turns that
    exist (0 = padding turn, skipped: it neither discounts nor receives). Returns (B,K) with
    ``G_k = r_k + gamma * G_{k'}`` where k' is the next existing turn (0 after the last), 0 at
    padding turns. Each turn thus gets its own credit (what it earned from then on), instead of
    every token sharing the episode outcome. Broadcast ``G_k`` over turn k's policy tokens to
    use it as a per-turn return.
    """
    _check_2d("turn_mask", turn_mask)
    _check_2d("turn_rewards", turn_rewards, turn_mask)
    m = _bool_mask(turn_mask)
    r = turn_rewards.to(_float_dtype(turn_rewards))
    return _masked_discounted_cumsum(torch.where(m, r, torch.zeros_like(r)), m, gamma)


# --------------------------------------------------------------------------------------------
# turns: segments of policy tokens
# --------------------------------------------------------------------------------------------


def turn_index(loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Number the turns of each row: a turn's reply is sampled in one piece, so its policy tokens
    form one maximal run of ``loss_mask == 1``, and the runs of a row are its turns in order.

    ``loss_mask`` (B,T). Returns ``(segment, counts)``: ``segment`` (B,T) long, the 0-based run
    number of each policy token and -1 at masked tokens; ``counts`` (B,) long, runs per row.
    """
    _check_2d("loss_mask", loss_mask)
    m = _bool_mask(loss_mask)
    prev = torch.zeros_like(m)
    prev[:, 1:] = m[:, :-1]
    starts = m & ~prev
    seg = starts.long().cumsum(dim=1) - 1
    return torch.where(m, seg, torch.full_like(seg, -1)), starts.sum(dim=1)


def _turn_columns(turn_mask: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor, int]:
    """For each policy token, the column (in the turn tensors) of its turn: the j-th run of policy
    tokens of a row belongs to the j-th EXISTING turn (``turn_mask == 1``) of that row.
    Returns ``(col (B,T) long, 0 at masked tokens; policy-token mask (B,T) bool; K >= 1)``.
    Raises ``ValueError`` naming the first row whose runs and turns differ in number."""
    _check_2d("loss_mask", loss_mask)
    _check_2d("turn_mask", turn_mask)
    if turn_mask.shape[0] != loss_mask.shape[0]:
        raise ValueError(
            f"turn_mask has {turn_mask.shape[0]} rows but loss_mask has {loss_mask.shape[0]}; give one row per episode"
        )
    m = _bool_mask(loss_mask)
    seg, counts = turn_index(m)
    tm = _bool_mask(turn_mask).to(m.device)
    n_turns = tm.sum(dim=1)
    bad = (n_turns != counts).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        raise ValueError(
            f"row {b}: {int(counts[b])} runs of policy tokens (loss_mask == 1) but {int(n_turns[b])} turns; "
            "each turn's reply must be one run of policy tokens (give turn rewards for the turns that sampled one)"
        )
    B, K = tm.shape
    if K == 0:  # no turns anywhere (and so no policy tokens): one dummy column keeps gathers valid
        tm = torch.zeros(B, 1, dtype=torch.bool, device=m.device)
        K = 1
    rank = tm.long().cumsum(dim=1) - 1
    slot = torch.where(tm, rank, torch.full_like(rank, K))  # non-existing turns go to a dump column
    col_of_rank = torch.zeros(B, K + 1, dtype=torch.long, device=m.device)
    col_of_rank.scatter_(1, slot, torch.arange(K, device=m.device).expand(B, K))
    col = col_of_rank.gather(1, seg.clamp_min(0))
    return torch.where(m, col, torch.zeros_like(col)), m, K


def _pad_turns(x: Tensor, K: int) -> Tensor:
    return x if x.shape[1] == K else torch.zeros(x.shape[0], K, dtype=x.dtype, device=x.device)


def broadcast_turns(turn_values: Tensor, turn_mask: Tensor, loss_mask: Tensor) -> Tensor:
    """``turn_values`` (B,K) -> (B,T): the value of turn k on every policy token of turn k (the
    k-th existing turn of a row owns its k-th run of policy tokens, see :func:`turn_index`), 0 at
    masked tokens."""
    _check_2d("turn_values", turn_values, turn_mask)
    col, m, K = _turn_columns(turn_mask, loss_mask)
    v = _pad_turns(turn_values.to(m.device), K)
    out = v.gather(1, col)
    return torch.where(m, out, torch.zeros_like(out))


def turn_sums(token_values: Tensor, turn_mask: Tensor, loss_mask: Tensor) -> Tensor:
    """``token_values`` (B,T) -> (B,K): for each existing turn, the sum of ``token_values`` over
    its policy tokens (values at masked tokens are never read); 0 at padding turns. The inverse
    direction of :func:`broadcast_turns`, e.g. to fold a per-token KL penalty into turn rewards."""
    _check_2d("loss_mask", loss_mask)
    _check_2d("token_values", token_values, loss_mask)
    col, m, K = _turn_columns(turn_mask, loss_mask)
    x = torch.where(m, token_values, torch.zeros_like(token_values))
    out = torch.zeros(x.shape[0], K, dtype=x.dtype, device=x.device).scatter_add_(1, col, x)
    return out[:, : turn_mask.shape[1]]


def place_rewards_on_turn_ends(turn_rewards: Tensor, turn_mask: Tensor, loss_mask: Tensor) -> Tensor:
    """Token rewards (B,T) with each existing turn's reward on the LAST policy token of its run
    (the action that earned it), 0 elsewhere: what a token-level estimator (gae, reinforce_pp)
    needs for per-turn rewards. ``turn_rewards``/``turn_mask`` (B,K), ``loss_mask`` (B,T)."""
    _check_2d("turn_rewards", turn_rewards, turn_mask)
    col, m, K = _turn_columns(turn_mask, loss_mask)
    nxt = torch.zeros_like(m)
    nxt[:, :-1] = m[:, 1:]
    ends = m & ~nxt
    r = _pad_turns(turn_rewards.to(device=m.device, dtype=_float_dtype(turn_rewards)), K).gather(1, col)
    return torch.where(ends, r, torch.zeros_like(r))


def _turn_group_stats(G: Tensor, tm: Tensor, idx: Tensor, n_groups: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per (row, turn) stats of ``G`` (B,K) over the rows of the same group that HAVE that turn
    index (``tm`` (B,K) bool): (count, sum, unbiased std, tied), each (B,K)."""
    B, K = G.shape
    w = tm.to(G.dtype)
    x = G * w
    counts = torch.zeros(n_groups, K, dtype=G.dtype, device=G.device).index_add_(0, idx, w)
    sums = torch.zeros(n_groups, K, dtype=G.dtype, device=G.device).index_add_(0, idx, x)
    mean = sums / counts.clamp_min(1)
    dev = (G - mean[idx]) * w
    sq = torch.zeros(n_groups, K, dtype=G.dtype, device=G.device).index_add_(0, idx, dev * dev)
    std = torch.sqrt(sq / (counts - 1).clamp_min(1))
    index = idx[:, None].expand(B, K)
    gmax = torch.full((n_groups, K), -math.inf, dtype=G.dtype, device=G.device).scatter_reduce(
        0, index, torch.where(tm, G, torch.full_like(G, -math.inf)), reduce="amax")
    gmin = torch.full((n_groups, K), math.inf, dtype=G.dtype, device=G.device).scatter_reduce(
        0, index, torch.where(tm, G, torch.full_like(G, math.inf)), reduce="amin")
    return counts[idx], sums[idx], std[idx], gmax[idx] == gmin[idx]


TURN_BASELINES = ("outcome", "turn", "state")


def turn_credit_advantages(
    estimator: Estimator | str,
    turn_rewards: Tensor,
    turn_mask: Tensor,
    loss_mask: Tensor,
    group_ids: Any = None,
    *,
    turn_gamma: float = 1.0,
    baseline: str = "outcome",
    norm_by_std: bool = True,
    eps: float = 1e-6,
    whiten_eps: float = 1e-8,
    state_ids: Tensor | None = None,
    step_advantage_weight: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Turn-level credit: each turn is credited with what it earned from then on.

    ``turn_rewards`` (B,K): turn k's own reward increment (they add up to the episode outcome);
    ``turn_mask`` (B,K) 1 for turns that exist; ``loss_mask`` (B,T) whose runs of policy tokens
    are the turns in order (one run per existing turn, see :func:`turn_index`). Turn k of row b
    has the return ``G_{b,k} = sum_{j>=k} turn_gamma^(j-k) r_{b,j}`` (:func:`turn_level_returns`)
    and its advantage is broadcast over the turn's policy tokens.

    ``baseline="outcome"`` compares ``G_{b,k}`` with the estimator's usual statistics of the
    episode OUTCOMES ``R = sum_k r_k``:

    * ``grpo``: ``(G_{b,k} - mean_g R) / (std_g R + eps)`` over the row's group g (unbiased std;
      ``norm_by_std=False``: ``G_{b,k} - mean_g R``); groups of size 1 or with tied outcomes -> 0.
    * ``rloo``: ``G_{b,k} - mean_{j in g, j != b} R_j``; size-1 / tied groups -> 0.
    * ``reinforce_pp``: ``G`` broadcast over policy tokens, whitened over all policy tokens of the
      batch (``(G - mean) * rsqrt(var + whiten_eps)``, unbiased var).

    With ``turn_gamma = 1`` turn 0's ``G_0`` is the outcome ``R``, so grpo/rloo give turn 0 exactly
    their outcome advantage. Later turns' ``G_k`` leave out the rewards before k, so they sit below
    the outcome baseline on average: an action-independent offset (no bias in expectation, but
    variance). ``baseline="turn"`` removes it by comparing like with like, the returns at the SAME
    turn index k, i.e. column k of the turn tensors (the turn's number in its episode: the group's
    rows that reached turn k started from the same task and are at the same depth):

    * ``grpo``: ``(G_{b,k} - mean G_{.,k}) / (std G_{.,k} + eps)`` over the group's rows that have a
      turn k; fewer than 2 such rows, or all their ``G_{.,k}`` equal -> 0 for that turn.
    * ``rloo``: ``G_{b,k} - mean_{j != b} G_{j,k}`` over the same rows; same zero cases.
    * ``reinforce_pp``: ``G_{b,k}`` minus the batch mean of ``G_{.,k}`` (over rows with a turn k),
      broadcast and whitened over all policy tokens of the batch.

    ``baseline="state"`` is GiGPO's (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM
    Agent Training", verl-agent): ``state_ids`` (B,K) integer ids of the environment state each
    turn acted in (equal ids = the same state). Within a group, the turns taken from the same
    state form a *step group* (an episode that comes back to a state adds a second entry), and
    turn k of row b gets the episode advantage plus ``step_advantage_weight`` (w) times its step
    advantage:

    * ``grpo``: ``(R_b - mean_g R) / (std_g R + eps) + w (G_{b,k} - mean_s G) / (std_s G + eps)``,
      ``s`` the step group of (b, k) (``norm_by_std=False``: both without the division);
    * ``rloo``: ``(R_b - mean_{j != b} R_j) + w (G_{b,k} - mean of the other entries of s)``;

    a group of size 1 or with tied outcomes has episode advantage 0, a step group with one entry
    or tied returns step advantage 0. ``state_ids`` are compared only within a group (the same id
    in two groups is two step groups). With ``turn_gamma < 1`` (GiGPO uses 0.95) a success reached
    sooner from the same state has the larger return. ``reinforce_pp`` does not take it.

    ``gae`` is not accepted: put turn rewards on tokens with :func:`place_rewards_on_turn_ends`
    and call :func:`gae_advantages`. Returns ``(advantages, returns)`` (B,T), 0 at masked tokens;
    ``returns`` is ``G`` broadcast.
    """
    est = _estimator(estimator)
    if est is Estimator.GAE:
        raise ValueError(
            "turn_credit_advantages does not take 'gae' (its critic assigns credit per token): place the "
            "turn rewards with place_rewards_on_turn_ends and call gae_advantages / compute_advantages"
        )
    if baseline not in TURN_BASELINES:
        raise ValueError(f"unknown turn baseline {baseline!r}; use one of {list(TURN_BASELINES)}")
    if est in (Estimator.GRPO, Estimator.RLOO) and group_ids is None:
        raise ValueError(
            f"estimator {est.value!r} needs group_ids (one id per row; rows of the same task share an id); "
            "pass group_ids=..., or use estimator='reinforce_pp' which needs no groups"
        )
    if baseline == "state":
        if est not in (Estimator.GRPO, Estimator.RLOO):
            raise ValueError(
                f"turn baseline 'state' (GiGPO) compares episodes within a group: use estimator 'grpo' or "
                f"'rloo', not {est.value!r}"
            )
        if state_ids is None:
            raise ValueError("turn baseline 'state' needs state_ids=(B,K) integer ids of the state each turn "
                             "acted in (equal ids = the same state)")
    _check_2d("turn_mask", turn_mask)
    _check_2d("turn_rewards", turn_rewards, turn_mask)
    with torch.no_grad():
        dtype = _float_dtype(turn_rewards)
        tm = _bool_mask(turn_mask)
        r = torch.where(tm, turn_rewards.to(dtype), torch.zeros((), dtype=dtype, device=turn_rewards.device))
        G = turn_level_returns(r, tm, turn_gamma)
        g_tok = broadcast_turns(G, tm, loss_mask).to(dtype)
        m = _bool_mask(loss_mask).to(g_tok.device)
        zeros = torch.zeros_like(g_tok)
        if est is Estimator.REINFORCE_PP:
            if baseline == "turn":
                w = tm.to(dtype)
                mean_k = (G * w).sum(dim=0) / w.sum(dim=0).clamp_min(1)
                centred = broadcast_turns(G - mean_k[None, :], tm, loss_mask).to(dtype)
                return masked_whiten(centred, m, eps=whiten_eps), g_tok
            return masked_whiten(g_tok, m, eps=whiten_eps), g_tok
        idx, n_groups = group_index(group_ids, r.shape[0], r.device)
        if baseline == "state":
            assert state_ids is not None  # checked above, with its error
            a = _state_group_advantages(est, r, G, tm, idx, n_groups, state_ids, step_advantage_weight,
                                        norm_by_std, eps)
            return broadcast_turns(a, tm, loss_mask).to(dtype), g_tok
        if baseline == "turn":
            count, total, std, tied = _turn_group_stats(G, tm, idx, n_groups)
            if est is Estimator.GRPO:
                a = G - total / count.clamp_min(1)
                if norm_by_std:
                    a = a / (std + eps)
            else:
                a = G - (total - G) / (count - 1).clamp_min(1)
            a = torch.where(tm & ~tied & (count >= 2), a, torch.zeros_like(a))
            return broadcast_turns(a, tm, loss_mask).to(dtype), g_tok
        scores = r.sum(dim=1)
        count, total, std, tied = _group_stats(scores, idx, n_groups)
        if est is Estimator.GRPO:
            adv = g_tok - (total / count)[:, None]
            if norm_by_std:
                adv = adv / (std + eps)[:, None]
        else:
            adv = g_tok - ((total - scores) / (count - 1).clamp_min(1))[:, None]
        dead = (tied | (count < 2))[:, None]
        adv = torch.where(m & ~dead, adv, zeros)
    return adv, g_tok


def _state_group_advantages(est: Estimator, r: Tensor, G: Tensor, tm: Tensor, idx: Tensor, n_groups: int,
                            state_ids: Tensor, step_weight: float, norm_by_std: bool, eps: float) -> Tensor:
    """GiGPO's (B,K) turn advantages: episode advantage + ``step_weight`` x step advantage (see
    :func:`turn_credit_advantages`, ``baseline="state"``); 0 at turns that do not exist."""
    _check_2d("state_ids", state_ids, tm)
    zeros = torch.zeros_like(G)

    def deviation(x: Tensor, members: Tensor, n: int) -> Tensor:
        """x's deviation within its set (grpo: from the mean, / std; rloo: from the others'
        mean); 0 in sets of one or with tied values."""
        count, total, std, tied = _group_stats(x, members, n)
        if est is Estimator.GRPO:
            d = x - total / count
            if norm_by_std:
                d = d / (std + eps)
        else:
            d = x - (total - x) / (count - 1).clamp_min(1)
        return torch.where(tied | (count < 2), torch.zeros_like(d), d)

    episode = deviation(r.sum(dim=1), idx, n_groups)
    step = zeros.clone()
    if tm.any():
        B, K = G.shape
        # a step group is (group, state): the same state id in two groups is two step groups
        pairs = torch.stack([idx[:, None].expand(B, K)[tm], state_ids.to(G.device).long()[tm]], dim=1)
        cluster, members = torch.unique(pairs, dim=0, return_inverse=True)
        step[tm] = deviation(G[tm], members, cluster.shape[0])
    return torch.where(tm, episode[:, None] + step_weight * step, zeros)


def compute_advantages(
    estimator: Estimator | str,
    token_rewards: Tensor,
    loss_mask: Tensor,
    group_ids: Any = None,
    *,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    whiten_gae: bool = True,
) -> tuple[Tensor, Tensor]:
    """Dispatch to the estimator named by ``estimator`` (an :class:`Estimator` or its value).

    grpo/rloo need ``group_ids``; gae needs ``values``; reinforce_pp uses ``gamma``; gae uses
    ``gamma`` and ``lam``; grpo uses ``norm_by_std``. For gae the advantages are whitened over
    the batch's policy tokens when ``whiten_gae`` (verl does the same); returns are not.
    Returns ``(advantages, returns)``, (B,T), 0 at masked tokens. Raises ``ValueError`` saying how
    to fix a missing input or an unknown estimator.
    """
    est = _estimator(estimator)
    if est in (Estimator.GRPO, Estimator.RLOO) and group_ids is None:
        raise ValueError(
            f"estimator {est.value!r} needs group_ids (one id per row; rows of the same task share an id "
            "so each is compared with its group); pass group_ids=..., or use estimator='reinforce_pp' "
            "which needs no groups"
        )
    if est is Estimator.GAE and values is None:
        raise ValueError(
            "estimator 'gae' needs values=(B,T) critic values at every token; compute them with the "
            "critic, or pick a critic-free estimator ('grpo', 'rloo', 'reinforce_pp')"
        )
    return ESTIMATORS[est](token_rewards, loss_mask, group_ids, values=values, gamma=gamma, lam=lam,
                           norm_by_std=norm_by_std, whiten_gae=whiten_gae)


def _gae_whitened(token_rewards: Tensor, loss_mask: Tensor, values: Tensor, *, gamma: float, lam: float,
                  whiten: bool) -> tuple[Tensor, Tensor]:
    adv, ret = gae_advantages(token_rewards, values, loss_mask, gamma=gamma, lam=lam)
    return (masked_whiten(adv, loss_mask) if whiten else adv), ret


#: ``compute_advantages``' table: each estimator over the common arguments
#: ``(token_rewards, loss_mask, group_ids, *, values, gamma, lam, norm_by_std, whiten_gae)``
ESTIMATORS: dict[Estimator, Callable[..., tuple[Tensor, Tensor]]] = {
    Estimator.GRPO: lambda r, m, g, *, norm_by_std, **_: grpo_advantages(r, m, g, norm_by_std=norm_by_std),
    Estimator.RLOO: lambda r, m, g, **_: rloo_advantages(r, m, g),
    Estimator.REINFORCE_PP: lambda r, m, g, *, gamma, **_: reinforce_pp_advantages(r, m, gamma=gamma),
    Estimator.GAE: lambda r, m, g, *, values, gamma, lam, whiten_gae, **_: _gae_whitened(
        r, m, values, gamma=gamma, lam=lam, whiten=whiten_gae),
}


# --------------------------------------------------------------------------------------------
# masked statistics
# --------------------------------------------------------------------------------------------


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask != 0`` (weights = mask values; x at masked
    positions is never read, even if NaN/inf). ``dim=None``: scalar; else reduce ``dim``. An
    empty selection gives 0."""
    mf = mask.to(_float_dtype(x))
    xs = torch.where(mf != 0, x * mf, torch.zeros_like(x))
    if dim is None:
        return xs.sum() / mf.sum().clamp_min(1e-8)
    return xs.sum(dim=dim) / mf.sum(dim=dim).clamp_min(1e-8)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over all masked-in positions (scalar). Unbiased (n-1) by default as verl;
    with fewer than 2 positions the (n-1) correction is skipped (gives 0, not a division by 0)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.to(_float_dtype(x)).sum()
        if n >= 2:
            var = var * n / (n - 1)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """``(x - mean) * rsqrt(var + eps)`` with mean/unbiased var over ``mask`` (the whole tensor,
    i.e. the batch); ``shift_mean=False`` adds the mean back (scale only). Returns a tensor of
    x's shape that is 0 at masked positions."""
    m = _bool_mask(mask)
    mean = masked_mean(x, m)
    var = masked_var(x, m)
    w = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        w = w + mean
    return torch.where(m, w, torch.zeros_like(w))


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """``1 - Var[returns - values] / Var[returns]`` over masked-in positions (unbiased). 1 =
    perfect critic, 0 = no better than a constant, < 0 worse. NaN when Var[returns] == 0."""
    var_y = masked_var(returns, mask)
    if float(var_y) == 0.0:
        return float("nan")
    return float(1.0 - masked_var(returns - values, mask) / var_y)


# --------------------------------------------------------------------------------------------
# losses
# --------------------------------------------------------------------------------------------


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL(pi || pi_ref) estimate from sampled-token log-probs (any equal shapes).

    * ``k1`` / ``kl``: ``lp - ref`` (unbiased, high variance, can be negative)
    * ``abs``: ``|lp - ref|``
    * ``k2`` / ``mse``: ``0.5 * (lp - ref)^2``
    * ``k3`` / ``low_var_kl``: ``exp(ref - lp) - (ref - lp) - 1`` (unbiased, >= 0, low variance);
      like verl, ``ref - lp`` is clamped to [-20, 20] and the result to [-10, 10].
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ in shape")
    name = estimator.lower()
    if name in ("k1", "kl"):
        return logprobs - ref_logprobs
    if name == "abs":
        return (logprobs - ref_logprobs).abs()
    if name in ("k2", "mse"):
        return 0.5 * (logprobs - ref_logprobs).square()
    if name in ("k3", "low_var_kl"):
        d = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
        return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; use one of {list(KL_ESTIMATORS)}")


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical softmax(logits) over the last dim: (B,T,V) -> (B,T)
    (``logsumexp(l) - sum softmax(l) * l``, as verl)."""
    pd = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (pd * logits).sum(dim=-1)


def entropy_from_logprobs(logprobs: Tensor) -> Tensor:
    """Entropy of the categorical with log-probabilities ``logprobs`` (normalised over the last
    dim): ``-sum exp(lp) * lp``, (B,T,V) -> (B,T); equals ``entropy_from_logits`` of the logits
    they were normalised from (tested), in one pass over the vocabulary."""
    return -(logprobs.exp() * logprobs).sum(dim=-1)


def aggregate_loss(loss_mat: Tensor, loss_mask: Tensor, mode: str, *, norm_length: int | None = None) -> Tensor:
    """Reduce a per-token loss ``loss_mat`` (B,T) over policy tokens (``loss_mask`` (B,T)) to a scalar.

    * ``token-mean``: sum(loss*mask) / sum(mask) (every policy token weighs the same).
    * ``seq-mean-token-mean``: mean over rows of each row's token mean; rows without any policy
      token are left out (verl would divide by 0 there).
    * ``seq-mean-token-sum``: mean over rows of each row's token sum; rows without any policy
      token are left out, as in ``seq-mean-token-mean`` (and verl since its PR #3915), so padding
      a batch with empty rows does not shrink the loss.
    * ``seq-mean-token-sum-norm`` (Dr. GRPO, verl's definition): sum(loss*mask) / L with L =
      ``norm_length`` if given else T = ``loss_mask.shape[-1]`` (a constant L reproduces Dr. GRPO
      best; note it is a SUM over rows, not a mean).

    Values of ``loss_mat`` at masked positions are never read (nor get gradient).
    """
    _check_2d("loss_mask", loss_mask)
    _check_2d("loss_mat", loss_mat, loss_mask)
    m = _bool_mask(loss_mask)
    x = torch.where(m, loss_mat, torch.zeros_like(loss_mat))
    mf = m.to(_float_dtype(loss_mat))
    if mode == "token-mean":
        return x.sum() / mf.sum().clamp_min(1.0)
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        n = mf.sum(dim=-1)
        has = n > 0
        per_row = x.sum(dim=-1) / n.clamp_min(1.0) if mode == "seq-mean-token-mean" else x.sum(dim=-1)
        return (per_row * has).sum() / has.sum().clamp_min(1)
    if mode == "seq-mean-token-sum-norm":
        L = loss_mask.shape[-1] if norm_length is None else norm_length
        if L <= 0:
            raise ValueError(f"norm_length must be positive; got {L}")
        return x.sum() / L
    raise ValueError(f"unknown loss aggregation {mode!r}; use one of {list(LOSS_AGG_MODES)}")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    loss_agg: str = "token-mean",
    *,
    norm_length: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate with asymmetric clipping (clip-higher) and optional dual clip.

    All inputs (B,T). ``r = exp(logprobs - old_logprobs)`` (log-ratio clamped to [-20, 20]),
    per-token loss ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``; with ``dual_clip=c``
    (c > 1) tokens with A < 0 use ``min(that, -A c)`` so a huge ratio on a bad action cannot blow
    up the loss. Reduced with :func:`aggregate_loss` (``loss_agg``). Gradient flows into
    ``logprobs`` only at policy tokens.

    Metrics (Python floats, means over policy tokens): ``clipfrac_high`` (A > 0 and r > 1 +
    clip_high: clipped branch taken), ``clipfrac_low`` (A < 0 and r < 1 - clip_low),
    ``clipfrac`` (either; = low + high), ``dual_clipfrac`` (dual clip active), ``approx_kl``
    (mean 0.5 (lp - old)^2), ``ratio_mean``, ``policy_loss`` (the returned loss).
    """
    _check_2d("loss_mask", loss_mask)
    for name, t in (("logprobs", logprobs), ("old_logprobs", old_logprobs), ("advantages", advantages)):
        _check_2d(name, t, loss_mask)
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0; got clip_low={clip_low}, clip_high={clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (typically 3.0), or None to disable; got {dual_clip}")
    m = _bool_mask(loss_mask)
    old = old_logprobs.detach()
    adv = torch.where(m, advantages.detach(), torch.zeros_like(advantages))
    log_ratio_raw = torch.where(m, logprobs - old, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio_raw.clamp(-20.0, 20.0))
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(l1, l2)
    if dual_clip is not None:
        l3 = -adv * dual_clip
        pg = torch.where(adv < 0, torch.minimum(clipped, l3), clipped)
    else:
        pg = clipped
    loss = aggregate_loss(pg, m, loss_agg, norm_length=norm_length)
    with torch.no_grad():
        took_clip = l2 > l1
        metrics = {
            "clipfrac_high": float(masked_mean((took_clip & (adv > 0)).float(), m)),
            "clipfrac_low": float(masked_mean((took_clip & (adv < 0)).float(), m)),
            "clipfrac": float(masked_mean(took_clip.float(), m)),
            "dual_clipfrac": (
                float(masked_mean(((adv < 0) & (clipped > l3)).float(), m)) if dual_clip is not None else 0.0
            ),
            "approx_kl": float(masked_mean(0.5 * log_ratio_raw.square(), m)),
            "ratio_mean": float(masked_mean(ratio, m)),
            "policy_loss": float(loss),
        }
    return loss, metrics


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    loss_mask: Tensor,
    clip: float | None = 0.2,
    loss_agg: str = "token-mean",
    *,
    norm_length: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss (verl/PPO2): ``v_clip = old + clamp(v - old, -clip, clip)``,
    per-token ``max((v - R)^2, (v_clip - R)^2)``, loss = 0.5 * aggregate. ``clip=None`` disables
    clipping. All inputs (B,T); gradient flows into ``values`` at policy tokens only.
    Metrics: ``vf_clipfrac`` (fraction of policy tokens where the clipped term is larger),
    ``vf_loss``, ``vpred_mean``."""
    _check_2d("loss_mask", loss_mask)
    for name, t in (("values", values), ("old_values", old_values), ("returns", returns)):
        _check_2d(name, t, loss_mask)
    m = _bool_mask(loss_mask)
    zero = torch.zeros_like(values)
    v = torch.where(m, values, zero)
    old = torch.where(m, old_values.detach().to(values.dtype), zero)
    ret = torch.where(m, returns.detach().to(values.dtype), zero)
    l1 = (v - ret).square()
    if clip is not None:
        v_clip = old + (v - old).clamp(-clip, clip)
        l2 = (v_clip - ret).square()
        per_tok = torch.maximum(l1, l2)
    else:
        l2 = l1
        per_tok = l1
    loss = 0.5 * aggregate_loss(per_tok, m, loss_agg, norm_length=norm_length)
    with torch.no_grad():
        metrics = {
            "vf_clipfrac": float(masked_mean((l2 > l1).float(), m)),
            "vf_loss": float(loss),
            "vpred_mean": float(masked_mean(v, m)),
        }
    return loss, metrics


def sft_loss(logprobs: Tensor, loss_mask: Tensor, loss_agg: str = "token-mean", *,
             norm_length: int | None = None) -> tuple[Tensor, dict[str, float]]:
    """Supervised fine-tuning loss: the cross-entropy of the demonstrated tokens.

    ``logprobs`` (B, T): log-prob of each token under the policy at temperature 1 (read only where
    ``loss_mask`` (B, T) is 1, the expert's reply tokens); aggregated like the policy loss
    (``aggregate_loss``). Returns ``(loss, {"sft_loss": ...})``; ``exp(sft_loss)`` is the
    demonstrations' perplexity under ``token-mean``.
    """
    loss = aggregate_loss(-logprobs, loss_mask, loss_agg, norm_length=norm_length)
    return loss, {"sft_loss": float(loss.detach())}
