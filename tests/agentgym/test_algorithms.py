"""Tests of agentgym.algorithms: hand-computed closed forms, invariance to what sits at masked
(env/prompt/padding) positions, equivalence with plain-Python loop references written here
independently, and the multi-turn outcome-reward regression (reward after env tokens)."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from agentgym.algorithms import (
    LOSS_AGG_MODES,
    aggregate_loss,
    broadcast_turns,
    compute_advantages,
    entropy_from_logits,
    entropy_from_logprobs,
    explained_variance,
    gae_advantages,
    grpo_advantages,
    kl_penalty,
    masked_mean,
    masked_whiten,
    place_outcome_reward,
    place_rewards_on_turn_ends,
    policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    tied_groups,
    turn_credit_advantages,
    turn_index,
    turn_level_returns,
    turn_sums,
    value_loss,
)
from agentgym.config import Estimator

torch.set_num_threads(1)

F64 = torch.float64


def t64(x):
    return torch.tensor(x, dtype=F64)


# ----------------------------------------------------------------------------------------------
# plain-Python references (per row / per token loops; no torch)
# ----------------------------------------------------------------------------------------------


def ref_fold(rewards, mask):
    """Reward at a masked token -> nearest preceding policy token (dropped if none)."""
    out = [0.0] * len(rewards)
    last = None
    for t, (r, m) in enumerate(zip(rewards, mask)):
        if m:
            last = t
            out[t] += r
        elif last is not None:
            out[last] += r
    return out


def ref_scores_groups(rewards, groups):
    scores = [sum(row) for row in rewards]
    members = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    return scores, members


def ref_grpo(rewards, mask, groups, norm_by_std=True, eps=1e-6):
    scores, members = ref_scores_groups(rewards, groups)
    adv_row = [0.0] * len(scores)
    for idx in members.values():
        vals = [scores[i] for i in idx]
        if len(vals) < 2 or max(vals) == min(vals):
            continue
        mean = statistics.mean(vals)
        std = statistics.stdev(vals)  # unbiased, like torch.std
        for i in idx:
            adv_row[i] = (scores[i] - mean) / (std + eps) if norm_by_std else scores[i] - mean
    return [[adv_row[b] if m else 0.0 for m in mask[b]] for b in range(len(mask))]


def ref_rloo(rewards, mask, groups):
    scores, members = ref_scores_groups(rewards, groups)
    adv_row = [0.0] * len(scores)
    for idx in members.values():
        if len(idx) < 2 or len({scores[i] for i in idx}) == 1:
            continue
        for i in idx:
            others = [scores[j] for j in idx if j != i]
            adv_row[i] = scores[i] - sum(others) / len(others)
    return [[adv_row[b] if m else 0.0 for m in mask[b]] for b in range(len(mask))]


def ref_reinforce_pp(rewards, mask, gamma, eps=1e-8):
    returns = []
    for row_r, row_m in zip(rewards, mask):
        r = ref_fold(row_r, row_m)
        pos = [t for t, m in enumerate(row_m) if m]
        g = [0.0] * len(row_m)
        running = 0.0
        for t in reversed(pos):
            running = r[t] + gamma * running
            g[t] = running
        returns.append(g)
    flat = [returns[b][t] for b in range(len(mask)) for t in range(len(mask[b])) if mask[b][t]]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    adv = [
        [(returns[b][t] - mean) / math.sqrt(var + eps) if mask[b][t] else 0.0 for t in range(len(mask[b]))]
        for b in range(len(mask))
    ]
    return adv, returns


def ref_gae(rewards, values, mask, gamma, lam):
    advs, rets = [], []
    for row_r, row_v, row_m in zip(rewards, values, mask):
        r = ref_fold(row_r, row_m)
        pos = [t for t, m in enumerate(row_m) if m]
        a = [0.0] * len(row_m)
        ret = [0.0] * len(row_m)
        nxt_adv = 0.0
        for k in range(len(pos) - 1, -1, -1):
            t = pos[k]
            next_v = row_v[pos[k + 1]] if k + 1 < len(pos) else 0.0
            delta = r[t] + gamma * next_v - row_v[t]
            nxt_adv = delta + gamma * lam * nxt_adv
            a[t] = nxt_adv
            ret[t] = nxt_adv + row_v[t]
        advs.append(a)
        rets.append(ret)
    return advs, rets


def ref_turn_returns(turn_rewards, turn_mask, gamma):
    out = []
    for rs, ms in zip(turn_rewards, turn_mask):
        g = [0.0] * len(rs)
        running = 0.0
        for k in range(len(rs) - 1, -1, -1):
            if ms[k]:
                running = rs[k] + gamma * running
                g[k] = running
        out.append(g)
    return out


# ----------------------------------------------------------------------------------------------
# random multi-turn batches
# ----------------------------------------------------------------------------------------------


def random_batch(seed, B=12, T=40, n_groups=4, binary=False):
    """Rows: prompt, then alternating policy/env segments, then padding; some rows end on env
    tokens, one row has no policy token. Rewards: outcome at the last policy token, random
    turn rewards at ends of policy segments, and now and then a reward on an env token."""
    rng = random.Random(seed)
    mask = [[0] * T for _ in range(B)]
    rewards = [[0.0] * T for _ in range(B)]
    for b in range(B):
        if b == B - 1:
            continue  # row with no policy token at all
        length = rng.randint(T // 2, T)
        t = rng.randint(1, 5)
        while t < length:
            seg = rng.randint(1, 6)
            for i in range(t, min(t + seg, length)):
                mask[b][i] = 1
            end = min(t + seg, length) - 1
            if not binary and rng.random() < 0.5:
                rewards[b][end] += round(rng.uniform(-1, 1), 3)
            t += seg + rng.randint(1, 5)
        pol = [i for i in range(T) if mask[b][i]]
        if pol:
            rewards[b][pol[-1]] += float(rng.randint(0, 1)) if binary else round(rng.uniform(-2, 2), 3)
            env = [i for i in range(pol[0], T) if not mask[b][i]]
            if env and not binary and rng.random() < 0.3:
                rewards[b][rng.choice(env)] += 0.5
    groups = [f"task{rng.randrange(n_groups)}" for _ in range(B)]
    groups[0] = "solo"  # a group of size 1
    values = [[rng.uniform(-1, 1) for _ in range(T)] for _ in range(B)]
    return rewards, mask, groups, values


def as_tensors(rewards, mask, values=None):
    out = (t64(rewards), torch.tensor(mask, dtype=torch.long))
    return out + ((t64(values),) if values is not None else ())


# ----------------------------------------------------------------------------------------------
# 1. closed form
# ----------------------------------------------------------------------------------------------


def test_grpo_closed_form_unbiased_std():
    mask = torch.ones(4, 3, dtype=torch.long)
    mask[1, 2] = 0
    rewards = place_outcome_reward(t64([1.0, 0.0, 0.0, 1.0]), mask)
    adv, ret = grpo_advantages(rewards, mask, ["g"] * 4)
    # mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = sqrt(1/3) = 0.5773503 -> +-0.5/0.5773503 = +-0.8660254
    expected = 0.5 / (math.sqrt(1.0 / 3.0) + 1e-6)
    assert abs(expected - 0.8660239) < 1e-6
    torch.testing.assert_close(adv[:, 0], t64([expected, -expected, -expected, expected]))
    assert adv[1, 2] == 0.0 and adv[0, 2] == pytest.approx(expected)
    torch.testing.assert_close(ret[:, 0], t64([1.0, 0.0, 0.0, 1.0]))
    # Dr. GRPO: no std division -> +-0.5
    adv_dr, _ = grpo_advantages(rewards, mask, ["g"] * 4, norm_by_std=False)
    torch.testing.assert_close(adv_dr[:, 1], t64([0.5, -0.5, -0.5, 0.5]))


def test_grpo_two_groups_and_size_one_and_tied():
    mask = torch.ones(6, 2, dtype=torch.long)
    scores = t64([3.0, 1.0, 2.0, 2.0, 7.0, 4.0])
    rewards = place_outcome_reward(scores, mask)
    adv, _ = grpo_advantages(rewards, mask, [0, 0, 1, 1, 2, 0], norm_by_std=False)
    # group 0 = rows 0,1,5 scores 3,1,4 mean 8/3; group 1 tied -> 0; group 2 size 1 -> 0
    torch.testing.assert_close(adv[:, 0], t64([3 - 8 / 3, 1 - 8 / 3, 0.0, 0.0, 0.0, 4 - 8 / 3]))
    adv_std, _ = grpo_advantages(rewards, mask, [0, 0, 1, 1, 2, 0])
    std = math.sqrt(((1 / 3) ** 2 + (5 / 3) ** 2 + (4 / 3) ** 2) / 2)  # unbiased
    d = std + 1e-6
    torch.testing.assert_close(adv_std[:, 1], t64([(1 / 3) / d, (-5 / 3) / d, 0, 0, 0, (4 / 3) / d]))


def test_grpo_tied_group_is_exactly_zero_in_float32():
    # float32: 0.9 - (0.9 + 0.9 + 0.9) / 3 = 6e-8, and (6e-8) / (std ~ 3e-8 + 1e-6) would be ~0.06
    mask = torch.ones(3, 4)
    rewards = place_outcome_reward(torch.tensor([0.9, 0.9, 0.9]), mask)
    for est in ("grpo", "rloo"):
        adv, _ = compute_advantages(est, rewards, mask, ["a", "a", "a"])
        assert torch.count_nonzero(adv) == 0, est


def test_rloo_closed_form():
    mask = torch.ones(3, 2, dtype=torch.long)
    rewards = place_outcome_reward(t64([1.0, 0.0, 0.0]), mask)
    adv, ret = rloo_advantages(rewards, mask, ["x", "x", "x"])
    torch.testing.assert_close(adv[:, 0], t64([1.0, -0.5, -0.5]))
    torch.testing.assert_close(adv[:, 1], t64([1.0, -0.5, -0.5]))
    torch.testing.assert_close(ret[:, 0], t64([1.0, 0.0, 0.0]))
    # size-1 group -> 0
    adv1, _ = rloo_advantages(rewards, mask, ["x", "y", "y"])
    assert adv1[0].abs().sum() == 0 and adv1[1:].abs().sum() == 0  # rows 1,2 tied (0, 0)


def test_reinforce_pp_closed_form_two_turns():
    # prompt | turn 1 (2 tokens) | env (2) | turn 2 (2 tokens) | env
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0]])
    rewards = torch.zeros(1, 8, dtype=F64)
    rewards[0, 2] = 0.5  # turn-1 reward on its last policy token
    rewards[0, 6] = 1.0  # outcome on the last policy token
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    # returns over policy tokens only (env tokens do not discount):
    # t6: 1 ; t5: 0.5*1 = 0.5 ; t2: 0.5 + 0.5*0.5 = 0.75 ; t1: 0.5*0.75 = 0.375
    torch.testing.assert_close(ret, t64([[0, 0.375, 0.75, 0, 0, 0.5, 1.0, 0]]))
    # whitening: mean 2.625/4 = 0.65625 ; unbiased var = 0.23046875/3
    mean, var = 0.65625, 0.23046875 / 3
    exp = [0.0, 0.375, 0.75, 0.0, 0.0, 0.5, 1.0, 0.0]
    exp = [0.0 if m == 0 else (x - mean) / math.sqrt(var + 1e-8) for x, m in zip(exp, mask[0].tolist())]
    torch.testing.assert_close(adv, t64([exp]))


def test_gae_closed_form():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0]])
    values = t64([[9.0, 0.5, 0.4, 7.0, 0.2, 3.0]])  # 9, 7, 3 sit on masked tokens: never read
    rewards = t64([[0, 0, 0, 0, 1.0, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # t4: delta = 1 + 0.9*0 - 0.2 = 0.8 ; A = 0.8
    # t2: delta = 0 + 0.9*0.2 - 0.4 = -0.22 ; A = -0.22 + 0.72*0.8 = 0.356
    # t1: delta = 0 + 0.9*0.4 - 0.5 = -0.14 ; A = -0.14 + 0.72*0.356 = 0.11632
    torch.testing.assert_close(adv, t64([[0, 0.11632, 0.356, 0, 0.8, 0]]))
    torch.testing.assert_close(ret, t64([[0, 0.61632, 0.756, 0, 1.0, 0]]))


def test_turn_level_returns_closed_form():
    r = t64([[1.0, 0.0, 2.0], [1.0, 5.0, 2.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 1]])
    # row 0: [1 + .5*(0 + .5*2), 0 + .5*2, 2] = [1.5, 1, 2]; row 1 skips turn 1: [1 + .5*2, 0, 2]
    torch.testing.assert_close(turn_level_returns(r, m, 0.5), t64([[1.5, 1.0, 2.0], [2.0, 0.0, 2.0]]))


def test_place_outcome_reward():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    out = place_outcome_reward(torch.tensor([2.0, 3.0, -1.0]), mask)
    expected = torch.zeros(3, 7)
    expected[0, 4] = 2.0  # last policy token, NOT index 6 (env token)
    expected[2, 6] = -1.0
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError):
        place_outcome_reward(torch.tensor([1.0]), mask)


def test_tied_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 5.0])
    out = tied_groups(rewards, ["a", "a", "b", "b", "c", "c", "d"])
    assert out.tolist() == [True, True, False, False, True, True, True]
    out_t = tied_groups(rewards, torch.tensor([9, 9, 4, 4, 1, 1, 100]))
    assert out_t.tolist() == out.tolist()


def test_group_ids_tensor_and_list_agree():
    rewards, mask, _, _ = random_batch(3, B=8)
    r, m = as_tensors(rewards, mask)
    a1, _ = grpo_advantages(r, m, torch.tensor([7, 3, 7, 3, 7, 3, 11, 11]))
    a2, _ = grpo_advantages(r, m, ["x", "y", "x", "y", "x", "y", "z", "z"])
    torch.testing.assert_close(a1, a2)
    with pytest.raises(ValueError, match="one id per row"):
        grpo_advantages(r, m, ["x"] * 7)


# ----------------------------------------------------------------------------------------------
# 2. invariance to masked positions
# ----------------------------------------------------------------------------------------------


def insert_env_tokens(rewards, mask, values, seed, n_insert=6):
    """Insert zero-reward env tokens (random values) at random places; returns new lists and,
    per row, the map old position -> new position."""
    rng = random.Random(seed)
    R, M, V, maps = [], [], [], []
    for row_r, row_m, row_v in zip(rewards, mask, values):
        where = sorted(rng.randrange(len(row_r) + 1) for _ in range(n_insert))
        nr, nm, nv, mp = [], [], [], []
        k = 0
        for t in range(len(row_r) + 1):
            while k < len(where) and where[k] == t:
                nr.append(0.0), nm.append(0), nv.append(rng.uniform(-50, 50))
                k += 1
            if t < len(row_r):
                mp.append(len(nr))
                nr.append(row_r[t]), nm.append(row_m[t]), nv.append(row_v[t])
        R.append(nr), M.append(nm), V.append(nv), maps.append(mp)
    return R, M, V, maps


@pytest.mark.parametrize("estimator", [e.value for e in Estimator])
def test_estimators_ignore_inserted_env_tokens(estimator):
    rewards, mask, groups, values = random_batch(11)
    r, m, v = as_tensors(rewards, mask, values)
    adv, ret = compute_advantages(estimator, r, m, groups, values=v, gamma=0.9, lam=0.95)
    R2, M2, V2, maps = insert_env_tokens(rewards, mask, values, seed=5)
    r2, m2, v2 = as_tensors(R2, M2, V2)
    adv2, ret2 = compute_advantages(estimator, r2, m2, groups, values=v2, gamma=0.9, lam=0.95)
    for b, mp in enumerate(maps):
        idx = torch.tensor(mp)
        torch.testing.assert_close(adv2[b, idx], adv[b], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(ret2[b, idx], ret[b], rtol=1e-9, atol=1e-9)
    assert adv2[m2 == 0].abs().sum() == 0 and ret2[m2 == 0].abs().sum() == 0


@pytest.mark.parametrize("estimator", [e.value for e in Estimator])
def test_estimators_ignore_values_at_masked_positions(estimator):
    rewards, mask, groups, values = random_batch(12)
    r, m, v = as_tensors(rewards, mask, values)
    noise = torch.randn_like(v, generator=torch.Generator().manual_seed(0)) * 100
    v2 = torch.where(m.bool(), v, noise)
    a1, r1 = compute_advantages(estimator, r, m, groups, values=v, gamma=0.97, lam=0.9)
    a2, r2 = compute_advantages(estimator, r, m, groups, values=v2, gamma=0.97, lam=0.9)
    torch.testing.assert_close(a1, a2, rtol=0, atol=0)
    torch.testing.assert_close(r1, r2, rtol=0, atol=0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_policy_loss_ignores_masked_positions(mode, dual_clip):
    g = torch.Generator().manual_seed(1)
    _, mask, _, _ = random_batch(13)
    m = torch.tensor(mask, dtype=torch.long)
    lp = -torch.rand(m.shape, generator=g, dtype=F64) * 3
    old = lp + torch.randn(m.shape, generator=g, dtype=F64) * 0.4
    adv = torch.randn(m.shape, generator=g, dtype=F64)

    def scramble(x, scale):
        noise = torch.randn(x.shape, generator=g, dtype=F64) * scale
        noise[:, -1] = float("nan")  # even NaN at masked positions must not leak (the last column is padding)
        noise[:, 0] = float("inf")  # column 0 is prompt
        return torch.where(m.bool(), x, noise)

    results = []
    for lp_in, old_in, adv_in in ((lp, old, adv), (scramble(lp, 30), scramble(old, 30), scramble(adv, 1e3))):
        x = lp_in.clone().requires_grad_(True)
        loss, metrics = policy_loss(x, old_in, adv_in, m, 0.2, 0.28, dual_clip, mode)
        loss.backward()
        results.append((loss.detach(), metrics, x.grad))
    (l1, m1, g1), (l2, m2, g2) = results
    torch.testing.assert_close(l1, l2, rtol=0, atol=0)
    assert m1 == m2
    torch.testing.assert_close(g1, g2, rtol=0, atol=0)
    assert g2[m == 0].abs().sum() == 0


def test_value_loss_ignores_masked_positions():
    g = torch.Generator().manual_seed(2)
    _, mask, _, _ = random_batch(14)
    m = torch.tensor(mask).bool()
    v, old, ret = (torch.randn(m.shape, generator=g, dtype=F64) for _ in range(3))
    outs = []
    for scale in (None, 100.0):
        if scale is None:
            ins = (v, old, ret)
        else:
            noise = torch.randn(m.shape, generator=g, dtype=F64) * scale
            noise[:, 0] = float("nan")  # column 0 is prompt
            ins = tuple(torch.where(m, x, noise) for x in (v, old, ret))
        x = ins[0].clone().requires_grad_(True)
        loss, met = value_loss(x, ins[1], ins[2], m, clip=0.2)
        loss.backward()
        outs.append((loss.detach(), met, x.grad))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=0)
    assert outs[0][1] == outs[1][1]
    torch.testing.assert_close(outs[0][2], outs[1][2], rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# 3. equivalence with the loop references
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_matches_reference(seed):
    rewards, mask, groups, _ = random_batch(seed, binary=(seed == 2))
    r, m = as_tensors(rewards, mask)
    for norm in (True, False):
        adv, _ = grpo_advantages(r, m, groups, norm_by_std=norm)
        torch.testing.assert_close(adv, t64(ref_grpo(rewards, mask, groups, norm)), rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rloo_matches_reference(seed):
    rewards, mask, groups, _ = random_batch(seed, binary=(seed == 2))
    r, m = as_tensors(rewards, mask)
    adv, _ = rloo_advantages(r, m, groups)
    torch.testing.assert_close(adv, t64(ref_rloo(rewards, mask, groups)), rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed,gamma", [(0, 1.0), (1, 0.9), (2, 0.5)])
def test_reinforce_pp_matches_reference(seed, gamma):
    rewards, mask, _, _ = random_batch(seed)
    r, m = as_tensors(rewards, mask)
    adv, ret = reinforce_pp_advantages(r, m, gamma=gamma)
    ref_adv, ref_ret = ref_reinforce_pp(rewards, mask, gamma)
    torch.testing.assert_close(ret, t64(ref_ret), rtol=0, atol=1e-6)
    torch.testing.assert_close(adv, t64(ref_adv), rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed,gamma,lam", [(0, 1.0, 1.0), (1, 0.99, 0.95), (2, 0.8, 0.5)])
def test_gae_matches_reference(seed, gamma, lam):
    rewards, mask, _, values = random_batch(seed)
    r, m, v = as_tensors(rewards, mask, values)
    adv, ret = gae_advantages(r, v, m, gamma=gamma, lam=lam)
    ref_adv, ref_ret = ref_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, t64(ref_adv), rtol=0, atol=1e-6)
    torch.testing.assert_close(ret, t64(ref_ret), rtol=0, atol=1e-6)


def test_turn_level_returns_matches_reference():
    rng = random.Random(4)
    tr = [[rng.uniform(-1, 1) for _ in range(7)] for _ in range(5)]
    tm = [[int(rng.random() < 0.7) for _ in range(7)] for _ in range(5)]
    out = turn_level_returns(t64(tr), torch.tensor(tm), 0.9)
    torch.testing.assert_close(out, t64(ref_turn_returns(tr, tm, 0.9)), rtol=0, atol=1e-12)


def test_float32_close_to_float64():
    rewards, mask, groups, values = random_batch(7)
    r, m, v = as_tensors(rewards, mask, values)
    for est in Estimator:
        a64, _ = compute_advantages(est, r, m, groups, values=v, gamma=0.95, lam=0.9)
        a32, _ = compute_advantages(est, r.float(), m, groups, values=v.float(), gamma=0.95, lam=0.9)
        assert a32.dtype == torch.float32
        torch.testing.assert_close(a32.double(), a64, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# 4. multi-turn: outcome reward after env tokens
# ----------------------------------------------------------------------------------------------


def test_outcome_after_env_tokens_reaches_policy_tokens():
    # prompt(2) | act(3) | obs(3) | act(2) | obs(4): the rows END with env tokens
    row = [0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0]
    mask = torch.tensor([row, row, row, row])
    outcome = t64([1.0, 0.0, 1.0, 0.0])
    token_rewards = place_outcome_reward(outcome, mask)
    assert token_rewards[:, -1].abs().sum() == 0 and token_rewards[0, 9] == 1.0
    values = torch.zeros(4, len(row), dtype=F64)
    groups = ["t", "t", "t", "t"]
    pol = mask.bool()
    for est in Estimator:
        adv, _ = compute_advantages(est, token_rewards, mask, groups, values=values)
        assert (adv[:, pol[0]] != 0).all(), est  # GAE: whitened by compute_advantages
        assert adv[~pol].abs().sum() == 0
        assert (adv[0][pol[0]] > 0).all() and (adv[1][pol[0]] < 0).all(), est  # success > failure
    # un-whitened GAE: rewarded rows get +1 at every policy token (gamma = lam = 1, V = 0)
    adv, _ = gae_advantages(token_rewards, values, mask)
    assert torch.equal(adv[0][pol[0]], torch.ones(5, dtype=F64))


def test_reward_on_trailing_env_token_is_credited_not_lost():
    """The original AgentGym-RL bug: the outcome on the row's last token (an env token) was
    masked away. Sequence estimators credit it to the last policy token instead."""
    row = [0, 1, 1, 0, 1, 1, 0, 0]
    mask = torch.tensor([row, row])
    on_env = torch.zeros(2, 8, dtype=F64)
    on_env[0, 7] = 1.0
    on_policy = place_outcome_reward(t64([1.0, 0.0]), mask)
    values = t64([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]] * 2)
    for est in Estimator:
        a_env, r_env = compute_advantages(est, on_env, mask, ["g", "g"], values=values, gamma=0.9, lam=0.9)
        a_pol, r_pol = compute_advantages(est, on_policy, mask, ["g", "g"], values=values, gamma=0.9, lam=0.9)
        torch.testing.assert_close(a_env, a_pol)
        torch.testing.assert_close(r_env, r_pol)
        assert a_env[0, 5] != 0


# ----------------------------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------------------------


def test_compute_advantages_dispatch_and_errors():
    rewards, mask, groups, values = random_batch(8)
    r, m, v = as_tensors(rewards, mask, values)
    torch.testing.assert_close(compute_advantages("GRPO", r, m, groups)[0], grpo_advantages(r, m, groups)[0])
    torch.testing.assert_close(
        compute_advantages(Estimator.GRPO, r, m, groups, norm_by_std=False)[0],
        grpo_advantages(r, m, groups, norm_by_std=False)[0],
    )
    torch.testing.assert_close(compute_advantages("rloo", r, m, groups)[0], rloo_advantages(r, m, groups)[0])
    torch.testing.assert_close(
        compute_advantages("reinforce_pp", r, m, gamma=0.7)[0], reinforce_pp_advantages(r, m, gamma=0.7)[0]
    )
    raw, ret = gae_advantages(r, v, m, gamma=0.9, lam=0.8)
    a, rr = compute_advantages("gae", r, m, values=v, gamma=0.9, lam=0.8)
    torch.testing.assert_close(a, masked_whiten(raw, m))
    torch.testing.assert_close(rr, ret)
    torch.testing.assert_close(compute_advantages("gae", r, m, values=v, whiten_gae=False)[0], gae_advantages(r, v, m)[0])
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", r, m, groups)
    for est in ("grpo", Estimator.RLOO):
        with pytest.raises(ValueError, match="group_ids"):
            compute_advantages(est, r, m)
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages("ppo2", r, m, groups)
    with pytest.raises(ValueError, match="shape"):
        grpo_advantages(r[:, :-1], m, groups)


# ----------------------------------------------------------------------------------------------
# 5. KL, entropy, aggregation, policy / value loss, statistics
# ----------------------------------------------------------------------------------------------


def test_kl_estimators_closed_form():
    lp, ref = t64([math.log(0.5)]), t64([math.log(0.25)])
    # d = ref - lp = log(0.5) = -0.6931472
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), t64([0.6931472]), atol=1e-7, rtol=0)
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), t64([0.5 * 0.6931472**2]), atol=1e-7, rtol=0)
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), t64([0.5 + 0.6931472 - 1.0]), atol=1e-7, rtol=0)
    torch.testing.assert_close(kl_penalty(lp, ref, "abs"), t64([0.6931472]), atol=1e-7, rtol=0)
    # k3 clamp: ref - lp = 30 -> clamped to 20 -> exp(20) - 21 -> clamped to 10
    assert kl_penalty(t64([0.0]), t64([30.0]), "k3").item() == 10.0
    assert kl_penalty(t64([0.0]), t64([0.0]), "k3").item() == 0.0
    lp_far = t64([0.0, 0.0]).requires_grad_(True)
    kl_penalty(lp_far, t64([1000.0, -1000.0]), "k3").sum().backward()  # exp(1000) = inf without the clamp
    assert torch.isfinite(lp_far.grad).all()
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, "k4")


def test_k1_k3_are_unbiased_for_categorical_kl():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=g, dtype=F64), 0)
    q = torch.softmax(torch.randn(6, generator=g, dtype=F64), 0)
    kl = (p * (p.log() - q.log())).sum()
    for est in ("k1", "k3"):
        # E_{x~p}[k(x)] summed exactly over the support
        torch.testing.assert_close((p * kl_penalty(p.log(), q.log(), est)).sum(), kl)
    assert (kl_penalty(p.log(), q.log(), "k3") >= 0).all()


def test_entropy_from_logits():
    logits = torch.zeros(2, 3, 8, dtype=F64)
    torch.testing.assert_close(entropy_from_logits(logits), torch.full((2, 3), math.log(8), dtype=F64))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g, dtype=F64) * 3
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), expected)
    peaked = torch.tensor([[[100.0, 0.0, 0.0]]], dtype=F64)
    assert entropy_from_logits(peaked).item() < 1e-30


def test_entropy_from_logprobs_equals_it_from_the_logits():
    """The trainer's one-pass form (from the log-probs it already has) against the closed form
    (uniform: log V), torch's Categorical, and ``entropy_from_logits``."""
    uniform = torch.log_softmax(torch.zeros(2, 3, 8, dtype=F64), -1)
    torch.testing.assert_close(entropy_from_logprobs(uniform), torch.full((2, 3), math.log(8), dtype=F64))
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 50, generator=g, dtype=F64) * 4
    lp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(entropy_from_logprobs(lp), entropy_from_logits(logits))
    torch.testing.assert_close(entropy_from_logprobs(lp), torch.distributions.Categorical(logits=logits).entropy())
    peaked = torch.log_softmax(torch.tensor([[[1000.0, 0.0, 0.0]]], dtype=F64), -1)
    assert entropy_from_logprobs(peaked).item() == 0.0  # exp underflows to 0, never 0 * -inf = nan


def test_aggregate_loss_modes_hand_computed():
    loss = t64([[1, 2, 3, 4], [5, 6, 7, 8]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(21 / 5)  # (1+2+5+6+7)/5
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 6.0) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 18) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx((3 + 18) / 4)  # / T
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_length=10).item() == pytest.approx(2.1)
    # a row without policy tokens is left out of both seq-mean modes (verl's rule since PR #3915)
    mask3 = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]])
    assert aggregate_loss(loss, mask3, "seq-mean-token-mean").item() == pytest.approx(1.5)
    assert aggregate_loss(loss, mask3, "seq-mean-token-sum").item() == pytest.approx(3.0)
    assert aggregate_loss(loss, torch.zeros_like(mask), "token-mean").item() == 0.0
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate_loss(loss, mask, "mean")


def test_policy_loss_clip_fractions_and_value():
    ratios = [1.5, 0.5, 1.1, 0.7, 1.5, 0.5]
    advs = [1.0, -1.0, 1.0, -1.0, -1.0, 1.0]
    lp = torch.log(t64([ratios])).requires_grad_(True)
    old = torch.zeros(1, 6, dtype=F64)
    mask = torch.ones(1, 6, dtype=torch.long)
    loss, met = policy_loss(lp, old, t64([advs]), mask, clip_low=0.2, clip_high=0.28)
    # per token: -1.28 (high clip) ; 0.8 (low clip) ; -1.1 ; 0.8 (low clip) ; 1.5 (A<0, r high: unclipped) ; -0.5
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 1.1 + 0.8 + 1.5 - 0.5) / 6)
    assert met["clipfrac_high"] == pytest.approx(1 / 6)
    assert met["clipfrac_low"] == pytest.approx(2 / 6)
    assert met["clipfrac"] == pytest.approx(3 / 6)
    assert met["dual_clipfrac"] == 0.0
    assert met["approx_kl"] == pytest.approx(sum(0.5 * math.log(r) ** 2 for r in ratios) / 6)
    assert all(isinstance(v, float) for v in met.values())
    loss.backward()
    # d/dlp of -A r = -A r at unclipped tokens, 0 at clipped ones; token-mean divides by 6
    expected = [0.0, 0.0, -1.1 / 6, 0.0, 1.5 / 6, -0.5 / 6]
    torch.testing.assert_close(lp.grad, t64([expected]))


def test_policy_loss_dual_clip():
    lp = torch.log(t64([[5.0, 5.0, 0.5, 2.0]])).requires_grad_(True)
    adv = t64([[-1.0, 1.0, -1.0, -2.0]])
    mask = torch.ones(1, 4)
    loss, met = policy_loss(lp, torch.zeros(1, 4, dtype=F64), adv, mask, 0.2, 0.2, dual_clip=3.0)
    # t0: A<0, r=5: unclipped 5 > 3 -> dual clip 3 ; t1: A>0 -> -1.2 ; t2: 0.8 ; t3: A=-2, r=2: 4 < 6 -> 4
    assert loss.item() == pytest.approx((3.0 - 1.2 + 0.8 + 4.0) / 4)
    assert met["dual_clipfrac"] == pytest.approx(1 / 4)
    loss.backward()
    torch.testing.assert_close(lp.grad, t64([[0.0, 0.0, 0.0, 4.0 / 4]]))
    loss_nodual, _ = policy_loss(lp.detach(), torch.zeros(1, 4, dtype=F64), adv, mask, 0.2, 0.2)
    assert loss_nodual.item() == pytest.approx((5.0 - 1.2 + 0.8 + 4.0) / 4)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(lp, torch.zeros(1, 4, dtype=F64), adv, mask, dual_clip=1.0)


def test_policy_loss_extreme_ratio_stays_finite():
    # log-ratio 1000 with A < 0 and no dual clip: unclamped exp would give an infinite loss; verl
    # clamps the log-ratio to [-20, 20]
    lp = t64([[1000.0, -1000.0]]).requires_grad_(True)
    loss, met = policy_loss(lp, torch.zeros(1, 2, dtype=F64), t64([[-1.0, 1.0]]), torch.ones(1, 2))
    # t0: A=-1, r=e^20 (unclipped side for A<0) -> e^20 ; t1: A=+1, r=e^-20 (unclipped side) -> -e^-20
    assert loss.item() == pytest.approx((math.exp(20.0) - math.exp(-20.0)) / 2)
    loss.backward()
    assert torch.isfinite(lp.grad).all() and met["clipfrac"] == 0.0


def test_policy_loss_on_policy_is_minus_mean_advantage():
    g = torch.Generator().manual_seed(3)
    lp = -torch.rand(3, 7, generator=g, dtype=F64)
    adv = torch.randn(3, 7, generator=g, dtype=F64)
    mask = (torch.rand(3, 7, generator=g) < 0.6).long()
    loss, met = policy_loss(lp, lp, adv, mask)
    assert loss.item() == pytest.approx(-masked_mean(adv, mask).item())
    assert met["clipfrac"] == 0.0 and met["approx_kl"] == 0.0 and met["ratio_mean"] == 1.0


def test_value_loss_hand_computed():
    v = t64([[1.0, 0.0]]).requires_grad_(True)
    loss, met = value_loss(v, t64([[0.5, 0.5]]), t64([[2.0, 2.0]]), torch.ones(1, 2), clip=0.2)
    # t0: v_clip = 0.7 -> max((1-2)^2, (0.7-2)^2) = 1.69 (clipped) ; t1: v_clip 0.3 -> max(4, 2.89) = 4
    assert loss.item() == pytest.approx(0.5 * (1.69 + 4.0) / 2)
    assert met["vf_clipfrac"] == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(v.grad, t64([[0.0, 0.5 * 2 * (0.0 - 2.0) / 2]]))
    loss_nc, met_nc = value_loss(v.detach(), t64([[0.5, 0.5]]), t64([[2.0, 2.0]]), torch.ones(1, 2), clip=None)
    assert loss_nc.item() == pytest.approx(0.5 * (1.0 + 4.0) / 2) and met_nc["vf_clipfrac"] == 0.0


def test_masked_stats():
    x = t64([[1.0, 2.0, 100.0], [3.0, float("nan"), 4.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert masked_mean(x, mask).item() == pytest.approx(2.5)
    torch.testing.assert_close(masked_mean(x, mask, dim=1), t64([1.5, 3.5]))
    w = masked_whiten(x, mask)
    sel = w[mask.bool()]
    assert sel.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert sel.std().item() == pytest.approx(1.0, abs=1e-6)  # unbiased
    assert w[~mask.bool()].abs().sum() == 0
    w2 = masked_whiten(x, mask, shift_mean=False)
    assert w2[mask.bool()].mean().item() == pytest.approx(2.5)
    rets = t64([[1.0, 2.0, 3.0, 4.0]])
    m = torch.ones(1, 4)
    assert explained_variance(rets, rets, m) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(rets, 2.5), rets, m) == pytest.approx(0.0)
    assert math.isnan(explained_variance(rets, torch.full_like(rets, 3.0), m))  # Var[returns] = 0



# ----------------------------------------------------------------------------------------------
# 6. turn-level credit
# ----------------------------------------------------------------------------------------------


def ref_runs(mask_row):
    """Maximal runs of policy tokens of one row: list of position lists, in order."""
    runs, cur = [], []
    for t, m in enumerate(mask_row):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def ref_turn_credit(est, turn_rewards, turn_mask, mask, groups, gamma, baseline="outcome", norm=True, eps=1e-6):
    """Per-row / per-turn loops: G_k, the estimator's baseline, broadcast onto the k-th run."""
    B = len(mask)
    G = ref_turn_returns(turn_rewards, turn_mask, gamma)
    R = [sum(r for r, m in zip(rs, ms) if m) for rs, ms in zip(turn_rewards, turn_mask)]
    turns = [[k for k, m in enumerate(ms) if m] for ms in turn_mask]  # existing turn columns
    members = {}
    for b, g in enumerate(groups or [None] * B):
        members.setdefault(g, []).append(b)
    adv_turn = [[0.0] * len(turn_mask[b]) for b in range(B)]
    if est == "reinforce_pp":
        centred = [list(row) for row in G]
        if baseline == "turn":
            for k in range(len(turn_mask[0])):
                have = [b for b in range(B) if turn_mask[b][k]]
                if have:
                    mk = sum(G[b][k] for b in have) / len(have)
                    for b in have:
                        centred[b][k] = G[b][k] - mk
        tok = [[0.0] * len(mask[b]) for b in range(B)]
        for b in range(B):
            for run, k in zip(ref_runs(mask[b]), turns[b]):
                for t in run:
                    tok[b][t] = centred[b][k]
        flat = [tok[b][t] for b in range(B) for t in range(len(mask[b])) if mask[b][t]]
        mean = sum(flat) / len(flat)
        var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
        adv = [[(tok[b][t] - mean) / math.sqrt(var + 1e-8) if mask[b][t] else 0.0 for t in range(len(mask[b]))]
               for b in range(B)]
    else:
        for idx in members.values():
            for b in idx:
                for k in turns[b]:
                    if baseline == "outcome":
                        pool = [R[j] for j in idx]
                        others = [R[j] for j in idx if j != b]
                    else:
                        pool = [G[j][k] for j in idx if turn_mask[j][k]]
                        others = [G[j][k] for j in idx if j != b and turn_mask[j][k]]
                    if len(pool) < 2 or max(pool) == min(pool):
                        continue
                    if est == "grpo":
                        a = G[b][k] - statistics.mean(pool)
                        adv_turn[b][k] = a / (statistics.stdev(pool) + eps) if norm else a
                    else:
                        adv_turn[b][k] = G[b][k] - sum(others) / len(others)
        adv = [[0.0] * len(mask[b]) for b in range(B)]
        for b in range(B):
            for run, k in zip(ref_runs(mask[b]), turns[b]):
                for t in run:
                    adv[b][t] = adv_turn[b][k]
    ret = [[0.0] * len(mask[b]) for b in range(B)]
    for b in range(B):
        for run, k in zip(ref_runs(mask[b]), turns[b]):
            for t in run:
                ret[b][t] = G[b][k]
    return adv, ret


def random_turn_batch(seed, B=12, T=40, n_groups=3, pad_turns=True):
    """random_batch's layout (runs of policy tokens separated by env tokens) with one turn per run,
    random turn rewards, and padding turns inserted at random columns."""
    rng = random.Random(seed)
    _, mask, _, _ = random_batch(seed, B=B, T=T)
    n_runs = [len(ref_runs(row)) for row in mask]
    K = max(n_runs) + (3 if pad_turns else 0)
    tr, tm = [], []
    for b in range(B):
        cols = sorted(rng.sample(range(K), n_runs[b])) if pad_turns else list(range(n_runs[b]))
        tr.append([round(rng.uniform(-0.5, 1.0), 3) if k in cols else rng.uniform(-9, 9) for k in range(K)])
        tm.append([int(k in cols) for k in range(K)])
    groups = [f"task{rng.randrange(n_groups)}" for _ in range(B)]
    groups[0] = "solo"
    # a group of two identical episodes: outcomes and every turn's return tie, advantages are 0
    groups[1] = groups[2] = "tie"
    mask[2], tr[2], tm[2] = list(mask[1]), list(tr[1]), list(tm[1])
    return tr, tm, mask, groups


def test_turn_index_and_turn_helpers_closed_form():
    m = torch.tensor([[0, 1, 1, 0, 0, 1, 0, 1, 1, 1, 0],
                      [0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0],
                      [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
    seg, counts = turn_index(m)
    assert seg.tolist()[0] == [-1, 0, 0, -1, -1, 1, -1, 2, 2, 2, -1]
    assert seg.tolist()[1] == [-1, -1, 0, 0, 0] + [-1] * 6
    assert counts.tolist() == [3, 1, 0]
    # row 0: turns in columns 0, 2, 3 (column 1 is a padding turn); row 1: column 1
    tr = t64([[0.1, 99.0, 0.2, 0.3], [99.0, 0.5, 99.0, 99.0], [99.0] * 4])
    tm = torch.tensor([[1, 0, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0]])
    b = broadcast_turns(tr, tm, m)
    assert b.tolist()[0] == [0, 0.1, 0.1, 0, 0, 0.2, 0, 0.3, 0.3, 0.3, 0]
    assert b.tolist()[1] == [0, 0, 0.5, 0.5, 0.5] + [0] * 6 and b[2].abs().sum() == 0
    x = torch.arange(33, dtype=F64).reshape(3, 11)
    assert turn_sums(x, tm, m).tolist() == [[1 + 2, 0, 5, 7 + 8 + 9], [0, 13 + 14 + 15, 0, 0], [0] * 4]
    ends = place_rewards_on_turn_ends(tr, tm, m)
    assert ends.tolist()[0] == [0, 0, 0.1, 0, 0, 0.2, 0, 0, 0, 0.3, 0]
    assert ends.tolist()[1] == [0, 0, 0, 0, 0.5] + [0] * 6
    # the same, placed by hand at each turn's last policy token (indices 2, 5, 9 and 4)
    explicit = torch.zeros(2, 11, dtype=F64)
    explicit[0, 2], explicit[0, 5], explicit[0, 9], explicit[1, 4] = 0.1, 0.2, 0.3, 0.5
    torch.testing.assert_close(ends[:2].to(F64), explicit)
    with pytest.raises(ValueError, match="row 0: 3 runs of policy tokens .* but 2 turns"):
        broadcast_turns(tr, torch.tensor([[1, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]]), m)
    # no turns at all: zero columns are fine
    assert broadcast_turns(torch.zeros(1, 0), torch.zeros(1, 0), torch.zeros(1, 5)).abs().sum() == 0


def test_turn_credit_closed_form():
    """Two episodes of one task, two turns each (gamma_turn = 0.5):
    row 0 turn rewards (0.2, 0.6): G = (0.2 + 0.5 * 0.6, 0.6) = (0.5, 0.6), R = 0.8
    row 1 turn rewards (0.1, 0.1): G = (0.15, 0.1), R = 0.2"""
    m = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 1, 0, 1, 1, 0]])
    tr, tm = t64([[0.2, 0.6], [0.1, 0.1]]), torch.ones(2, 2)
    g = ["t", "t"]
    adv, ret = turn_credit_advantages("grpo", tr, tm, m, g, turn_gamma=0.5, norm_by_std=False)
    # outcome baseline: mean R = 0.5
    torch.testing.assert_close(adv, t64([[0, 0.0, 0.0, 0, 0.1, 0], [0, -0.35, 0, -0.4, -0.4, 0]]))
    torch.testing.assert_close(ret, t64([[0, 0.5, 0.5, 0, 0.6, 0], [0, 0.15, 0, 0.1, 0.1, 0]]))
    std = math.sqrt(0.18)  # unbiased std of R = (0.8, 0.2)
    adv_s, _ = turn_credit_advantages("grpo", tr, tm, m, g, turn_gamma=0.5)
    torch.testing.assert_close(adv_s, adv / (std + 1e-6))
    # RLOO with two rows: the other row's outcome is the baseline
    adv_r, _ = turn_credit_advantages("rloo", tr, tm, m, g, turn_gamma=0.5)
    torch.testing.assert_close(adv_r, t64([[0, 0.3, 0.3, 0, 0.4, 0], [0, -0.65, 0, -0.7, -0.7, 0]]))
    # turn baseline: turn 0 compared with mean(0.5, 0.15) = 0.325, turn 1 with mean(0.6, 0.1) = 0.35
    adv_t, _ = turn_credit_advantages("grpo", tr, tm, m, g, turn_gamma=0.5, baseline="turn", norm_by_std=False)
    torch.testing.assert_close(adv_t, t64([[0, 0.175, 0.175, 0, 0.25, 0], [0, -0.175, 0, -0.25, -0.25, 0]]))
    adv_tr, _ = turn_credit_advantages("rloo", tr, tm, m, g, turn_gamma=0.5, baseline="turn")
    torch.testing.assert_close(adv_tr, t64([[0, 0.35, 0.35, 0, 0.5, 0], [0, -0.35, 0, -0.5, -0.5, 0]]))
    # REINFORCE++: G broadcast, whitened over the 6 policy tokens
    adv_p, ret_p = turn_credit_advantages("reinforce_pp", tr, tm, m, turn_gamma=0.5)
    torch.testing.assert_close(adv_p, masked_whiten(ret_p, m))


def test_turn_credit_with_gamma_one_gives_turn_zero_the_outcome_advantage():
    tr, tm, mask, groups = random_turn_batch(3, pad_turns=False)
    m = torch.tensor(mask)
    rows = [sum(r for r, k in zip(rs, ks) if k) for rs, ks in zip(tr, tm)]
    for est, fn in (("grpo", grpo_advantages), ("rloo", rloo_advantages)):
        out_adv, _ = fn(place_outcome_reward(t64(rows), m), m, groups)
        adv, _ = turn_credit_advantages(est, t64(tr), torch.tensor(tm), m, groups)
        seg, _ = turn_index(m)
        first = seg == 0
        torch.testing.assert_close(adv[first], out_adv[first])
    # one turn per episode: turn credit IS outcome credit, for every estimator and baseline
    one = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 1, 1], [1, 1, 0, 0]])
    R = t64([0.3, 0.9, 0.1, 0.4])
    g = ["a", "a", "b", "b"]
    for est in ("grpo", "rloo", "reinforce_pp"):
        want, _ = compute_advantages(est, place_outcome_reward(R, one), one, g)
        for baseline in ("outcome", "turn"):
            got, _ = turn_credit_advantages(est, R[:, None], torch.ones(4, 1), one, g, baseline=baseline)
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("baseline", ["outcome", "turn"])
@pytest.mark.parametrize("est", ["grpo", "rloo", "reinforce_pp"])
def test_turn_credit_matches_reference(seed, baseline, est):
    tr, tm, mask, groups = random_turn_batch(seed)
    gamma = (1.0, 0.9, 0.5)[seed]
    for norm in ((True, False) if est == "grpo" else (True,)):
        adv, ret = turn_credit_advantages(est, t64(tr), torch.tensor(tm), torch.tensor(mask), groups,
                                          turn_gamma=gamma, baseline=baseline, norm_by_std=norm)
        ref_adv, ref_ret = ref_turn_credit(est, tr, tm, mask, groups, gamma, baseline, norm)
        torch.testing.assert_close(ret, t64(ref_ret), rtol=0, atol=1e-9)
        torch.testing.assert_close(adv, t64(ref_adv), rtol=0, atol=1e-6)
    if est != "reinforce_pp":  # the size-1 group and the tied group get exactly 0
        for b in (0, 1, 2):
            assert adv[b].abs().sum() == 0
        assert adv.abs().sum() > 0


@pytest.mark.parametrize("baseline", ["outcome", "turn"])
@pytest.mark.parametrize("est", ["grpo", "rloo", "reinforce_pp"])
def test_turn_credit_ignores_env_tokens_and_padding_turns(est, baseline):
    """Extra env tokens (inserted next to masked tokens, so no run is split) and extra padding
    turns (at random columns, with garbage rewards) change nothing at the policy tokens."""
    tr, tm, mask, groups = random_turn_batch(21, pad_turns=False)
    adv, ret = turn_credit_advantages(est, t64(tr), torch.tensor(tm), torch.tensor(mask), groups,
                                      turn_gamma=0.8, baseline=baseline)
    rng = random.Random(9)
    M2, maps = [], []
    for row in mask:
        nm, mp = [], []
        for t, x in enumerate(row):
            if not x and rng.random() < 0.5:  # an env token before this env token
                nm.extend([0] * rng.randint(1, 3))
            mp.append(len(nm))
            nm.append(x)
        nm.extend([0] * rng.randint(0, 4))
        M2.append(nm)
        maps.append(mp)
    width = max(len(r) for r in M2)
    M2 = [r + [0] * (width - len(r)) for r in M2]
    K = len(tm[0])
    pads = sorted(rng.sample(range(K + 3), 3))  # new padding columns
    TR2, TM2 = [], []
    for rs, ms in zip(tr, tm):
        it = iter(zip(rs, ms))
        row_r, row_m = [], []
        for c in range(K + 3):
            if c in pads:
                row_r.append(rng.uniform(-50, 50)), row_m.append(0)
            else:
                r, x = next(it)
                row_r.append(r), row_m.append(x)
        TR2.append(row_r), TM2.append(row_m)
    m2 = torch.tensor(M2)
    adv2, ret2 = turn_credit_advantages(est, t64(TR2), torch.tensor(TM2), m2, groups, turn_gamma=0.8, baseline=baseline)
    for b, mp in enumerate(maps):
        idx = torch.tensor(mp)
        torch.testing.assert_close(adv2[b, idx], adv[b], rtol=0, atol=1e-12)
        torch.testing.assert_close(ret2[b, idx], ret[b], rtol=0, atol=1e-12)
    assert adv2[m2 == 0].abs().sum() == 0 and ret2[m2 == 0].abs().sum() == 0


def test_turn_credit_errors_say_how_to_fix():
    tr, tm, mask, groups = random_turn_batch(2)
    r, k, m = t64(tr), torch.tensor(tm), torch.tensor(mask)
    with pytest.raises(ValueError, match="place_rewards_on_turn_ends"):
        turn_credit_advantages("gae", r, k, m, groups)
    with pytest.raises(ValueError, match="group_ids"):
        turn_credit_advantages("grpo", r, k, m)
    with pytest.raises(ValueError, match="unknown turn baseline"):
        turn_credit_advantages("rloo", r, k, m, groups, baseline="step")
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        turn_credit_advantages("ppo", r, k, m, groups)
    k2 = k.clone()
    k2[3] = 0
    with pytest.raises(ValueError, match="row 3: .* runs of policy tokens"):
        turn_credit_advantages("grpo", r, k2, m, groups)


# ---------------------------------------------------------------- GiGPO: step groups by state
def test_state_baseline_closed_form():
    """One task, three episodes, turn_gamma 0.9; states: every episode starts in s0; rows 0 and 1
    both reach s1 at turn 1. Turn rewards: row 0 (0, 0, 1), row 1 (0, 1), row 2 (0, 0, 0).
    G: row 0 (0.81, 0.9, 1), row 1 (0.9, 1), row 2 (0, 0, 0); R = (1, 1, 0).
    Episode advantages (grpo): (R - 2/3) / std(R) = (1/3, 1/3, -2/3) / sqrt(1/3).
    Step group s0: G (0.81, 0.9, 0) -> mean 0.57; s1: G (0.9, 1) -> mean 0.95; the rest are
    single turns: step advantage 0."""
    tr = t64([[0, 0, 1], [0, 1, 0], [0, 0, 0]])
    tm = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    m = torch.tensor([[1, 0, 1, 0, 1], [1, 0, 1, 0, 0], [1, 0, 1, 0, 1]])
    sid = torch.tensor([[0, 1, 2], [0, 1, 9], [0, 3, 4]])
    g = ["t"] * 3
    ep = [1 / 3, 1 / 3, -2 / 3]
    step = {(0, 0): 0.81 - 0.57, (1, 0): 0.9 - 0.57, (2, 0): 0.0 - 0.57, (0, 1): 0.9 - 0.95, (1, 1): 1 - 0.95}

    def expected(norm: bool, w: float) -> torch.Tensor:
        sd_ep = statistics.stdev([1, 1, 0]) if norm else 1.0
        sd = {0: statistics.stdev([0.81, 0.9, 0.0]), 1: statistics.stdev([0.9, 1.0])} if norm else {0: 1.0, 1: 1.0}
        out = torch.zeros(3, 5, dtype=F64)
        for b in range(3):
            for k, t in enumerate([0, 2, 4]):
                if tm[b, k]:
                    eps = 1e-6 if norm else 0.0
                    a = ep[b] / (sd_ep + eps) + w * step.get((b, k), 0.0) / (sd.get(k, 1.0) + eps)
                    out[b, t] = a
        return out

    for norm in (True, False):
        for w in (1.0, 0.5):
            adv, ret = turn_credit_advantages("grpo", tr, tm, m, g, turn_gamma=0.9, baseline="state",
                                              state_ids=sid, norm_by_std=norm, step_advantage_weight=w)
            torch.testing.assert_close(adv, expected(norm, w), rtol=0, atol=1e-6)
    torch.testing.assert_close(ret, t64([[0.81, 0, 0.9, 0, 1], [0.9, 0, 1, 0, 0], [0, 0, 0, 0, 0]]))
    # RLOO: episode R_b - mean of the others; step G - mean of the step group's other entries
    adv, _ = turn_credit_advantages("rloo", tr, tm, m, g, turn_gamma=0.9, baseline="state", state_ids=sid)
    want = torch.zeros(3, 5, dtype=F64)
    want[0, 0], want[0, 2], want[0, 4] = 0.5 + 0.81 - 0.45, 0.5 + 0.9 - 1.0, 0.5
    want[1, 0], want[1, 2] = 0.5 + 0.9 - 0.405, 0.5 + 1.0 - 0.9
    want[2, 0], want[2, 2], want[2, 4] = -1.0 + 0.0 - 0.855, -1.0, -1.0
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-9)
    # weight 0: the outcome advantage, turn by turn
    adv0, _ = turn_credit_advantages("grpo", tr, tm, m, g, turn_gamma=0.9, baseline="state", state_ids=sid,
                                     step_advantage_weight=0.0)
    out, _ = grpo_advantages(place_outcome_reward(t64([1, 1, 0]), m), m, g)
    torch.testing.assert_close(adv0, out * torch.ones_like(adv0), rtol=0, atol=1e-9)


def ref_state_credit(est, turn_rewards, turn_mask, mask, groups, state_ids, gamma, norm=True, w=1.0, eps=1e-6):
    """Per-row / per-turn loops: GiGPO's episode advantage plus w x the deviation of G within
    the (group, state) step group, broadcast onto the k-th run."""
    B = len(mask)
    G = ref_turn_returns(turn_rewards, turn_mask, gamma)
    R = [sum(r for r, m in zip(rs, ms) if m) for rs, ms in zip(turn_rewards, turn_mask)]
    turns = [[k for k, m in enumerate(ms) if m] for ms in turn_mask]
    members, steps = {}, {}
    for b, g in enumerate(groups):
        members.setdefault(g, []).append(b)
        for k in turns[b]:
            steps.setdefault((g, state_ids[b][k]), []).append((b, k))

    def deviation(x, pool, others):
        if len(pool) < 2 or max(pool) == min(pool):
            return 0.0
        if est == "grpo":
            return (x - statistics.mean(pool)) / ((statistics.stdev(pool) + eps) if norm else 1.0)
        return x - sum(others) / len(others)

    adv = [[0.0] * len(mask[b]) for b in range(B)]
    for b in range(B):
        idx = members[groups[b]]
        episode = deviation(R[b], [R[j] for j in idx], [R[j] for j in idx if j != b])
        for run, k in zip(ref_runs(mask[b]), turns[b]):
            entries = steps[(groups[b], state_ids[b][k])]
            step = deviation(G[b][k], [G[j][q] for j, q in entries],
                             [G[j][q] for j, q in entries if (j, q) != (b, k)])
            for t in run:
                adv[b][t] = episode + w * step
    return adv


def _random_states(tm, seed, n_states=3):
    """State ids per turn column: few distinct ones, so step groups have several entries (some
    from one episode, some shared across groups, where they must not mix)."""
    rng = random.Random(seed)
    return [[rng.randrange(n_states) for _ in row] for row in tm]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("est", ["grpo", "rloo"])
def test_state_baseline_matches_reference(seed, est):
    tr, tm, mask, groups = random_turn_batch(seed)
    sid = _random_states(tm, seed)
    gamma = (1.0, 0.9, 0.5)[seed]
    for norm, w in (((True, 1.0), (False, 0.5)) if est == "grpo" else ((True, 1.0), (True, 2.0))):
        adv, _ = turn_credit_advantages(est, t64(tr), torch.tensor(tm), torch.tensor(mask), groups, turn_gamma=gamma,
                                        baseline="state", state_ids=torch.tensor(sid), norm_by_std=norm,
                                        step_advantage_weight=w)
        ref = ref_state_credit(est, tr, tm, mask, groups, sid, gamma, norm, w)
        torch.testing.assert_close(adv, t64(ref), rtol=0, atol=1e-6)
    assert adv.abs().sum() > 0


def test_state_baseline_ignores_env_tokens_padding_turns_and_state_ids_of_padding():
    tr, tm, mask, groups = random_turn_batch(5)
    sid = torch.tensor(_random_states(tm, 5))
    adv, _ = turn_credit_advantages("grpo", t64(tr), torch.tensor(tm), torch.tensor(mask), groups,
                                    baseline="state", state_ids=sid, turn_gamma=0.9)
    noisy = torch.where(torch.tensor(tm) == 1, sid, torch.randint(0, 3, sid.shape))  # padding turns' ids vary
    adv2, _ = turn_credit_advantages("grpo", t64(tr), torch.tensor(tm), torch.tensor(mask), groups,
                                     baseline="state", state_ids=noisy, turn_gamma=0.9)
    torch.testing.assert_close(adv2, adv, rtol=0, atol=0)
    assert adv[torch.tensor(mask) == 0].abs().sum() == 0
    # the same state ids in another group are another step group: renaming one group's ids changes nothing
    shifted = sid.clone()
    rows = [b for b, g in enumerate(groups) if g == groups[5]]
    shifted[rows] += 100
    adv3, _ = turn_credit_advantages("grpo", t64(tr), torch.tensor(tm), torch.tensor(mask), groups,
                                     baseline="state", state_ids=shifted, turn_gamma=0.9)
    torch.testing.assert_close(adv3, adv, rtol=0, atol=1e-12)


def test_state_baseline_errors_say_how_to_fix():
    tr, tm, mask, groups = random_turn_batch(2)
    r, k, m = t64(tr), torch.tensor(tm), torch.tensor(mask)
    with pytest.raises(ValueError, match="use estimator 'grpo' or 'rloo'"):
        turn_credit_advantages("reinforce_pp", r, k, m, groups, baseline="state", state_ids=torch.zeros_like(k))
    with pytest.raises(ValueError, match="needs state_ids"):
        turn_credit_advantages("grpo", r, k, m, groups, baseline="state")


def test_every_estimator_has_its_function_in_the_table():
    from agentgym.algorithms import ESTIMATORS
    from agentgym.config import Estimator

    assert set(ESTIMATORS) == set(Estimator)
