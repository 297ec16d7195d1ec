"""The RL options of ``algorithm`` through the pipeline (PolicySession.advantages / update):
PPO with a learned critic (gae), turn-level credit, KL as a reward penalty, recomputed old
log-probs; and the config combinations that are rejected, with how to fix them."""

from __future__ import annotations

import pytest
import torch

from agentgym import algorithms as A
from agentgym.config import ConfigError, parse_config
from agentgym.pipeline import IterationRef, PolicySession
from agentgym.rollout import loop as rollout
from agentgym.batch import EpisodeBatch

import multiturn_env
from configs import keyword_env, parse_tiny_config  # tests/ is on sys.path


def _cfg(tmp_path, model_cache, algo: dict, *, multi: bool = False, seed: int = 0, **kw):
    env = ({"name": multiturn_env.NAME, "tasks": list(range(4)), "kwargs": {"turns": 3}} if multi else
           keyword_env(tasks=list(range(4))))
    return parse_tiny_config(model_cache, store_root=tmp_path / "store", seed=seed, envs=[env],
                             rollout={"group_size": 3}, algorithm={"mini_batches": 2, **algo},
                             trainer={"learning_rate": 5e-3, "micro_batch_size": 4},
                             schedule={"stages": [{"horizon": 3 if multi else 1, "iterations": 2}]}, **kw)


def _layout(session: PolicySession, ref: IterationRef):
    episodes = [e for e in session.store.read_episodes(ref.stage, ref.iteration) if not e.infra_error]
    batch = EpisodeBatch.from_episodes(episodes).padded(session._pad_id())
    rewards = torch.tensor([e.reward for e in episodes])
    table = session.store.read_table("advantages", stage=ref.stage, iteration=ref.iteration)
    by_id = {r.episode_id: r for r in table.itertuples(index=False)}
    return episodes, batch, rewards, [e.group_id for e in episodes], by_id


def _assert_table(episodes, by_id, adv, ret):
    assert set(by_id) == {e.episode_id for e in episodes}
    for i, e in enumerate(episodes):
        n = len(e.input_ids)
        torch.testing.assert_close(torch.tensor(list(by_id[e.episode_id].advantages)), adv[i, :n].float(),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(list(by_id[e.episode_id].returns)), ret[i, :n].float(),
                                   rtol=1e-5, atol=1e-5)


def _spy(session: PolicySession) -> list[list[str]]:
    calls: list[list[str]] = []
    original = session.trainer.compute

    def compute(batch, what):
        calls.append(sorted(what))
        return original(batch, what)

    session.trainer.compute = compute
    return calls


# -- gae -------------------------------------------------------------------------------------
def test_gae_values_come_from_the_critic_before_the_update_and_are_reused(tmp_path, model_cache):
    algo = {"estimator": "gae", "gamma": 0.99, "lam": 0.9, "critic": {"model": "separate", "learning_rate": 5e-3}}
    cfg = _cfg(tmp_path, model_cache, algo)
    a, b = PolicySession(cfg, "gae-a"), PolicySession(cfg, "gae-b")
    calls = _spy(a)
    for step in range(2):
        ref = IterationRef(0, step, step)
        for s in (a, b):
            s.collect(ref, horizon=1)
        critic = a.trainer.critic_engine
        before = [p.detach().clone() for p in critic.module.parameters()]
        out = a.advantages(ref)
        assert all(torch.equal(x, p) for x, p in zip(before, critic.module.parameters()))  # read-only
        assert calls[-1] == ["values"]
        assert out["explained_variance"] <= 1.0 and (step > 0 or out["explained_variance"] == 0.0)  # V = 0 at first
        assert "value_mean" in out and "return_mean" in out
        episodes, batch, rewards, groups, by_id = _layout(a, ref)
        values = a.trainer.compute(batch, ["values"])["values"]
        calls.pop()
        want = A.compute_advantages("gae", A.place_outcome_reward(rewards, batch.loss_mask), batch.loss_mask,
                                    values=values, gamma=0.99, lam=0.9)
        _assert_table(episodes, by_id, *want)
        n_calls = len(calls)
        upd = a.update(ref)
        assert len(calls) == n_calls  # the update reused the advantages step's values
        assert upd["updated"] and upd["optimizer_steps"] == 2 and "vf_loss" in upd and "critic_grad_norm" in upd
        # session b recomputes the old values in its update (as a resumed run does): same result
        b.advantages(ref)
        b._old_values.clear()
        b.update(ref)
    for (k, p), (_, q) in zip(a.trainer.critic_engine.module.named_parameters(),
                              b.trainer.critic_engine.module.named_parameters()):
        assert torch.equal(p, q), k
    # export -> a new session on it starts from the exported critic; an export before any
    # update keeps it
    out = a.export(tmp_path / "ckpt")
    assert (out / "critic" / "critic.json").exists()
    c = PolicySession(cfg, "gae-c", weights=out)
    assert (c.export(tmp_path / "ckpt2") / "critic" / "value_head.safetensors").exists()
    torch.testing.assert_close(c.trainer.compute(batch, ["values"]), a.trainer.compute(batch, ["values"]),
                               rtol=0, atol=0)


# -- KL in the reward ------------------------------------------------------------------------
@pytest.mark.parametrize("recompute", [False, True])
def test_kl_penalty_is_added_to_the_token_rewards(tmp_path, model_cache, recompute):
    algo = {"estimator": "reinforce_pp", "gamma": 0.95, "kl_coef": 0.5, "kl_in_reward": True,
            "recompute_old_logprobs": recompute}
    session = PolicySession(_cfg(tmp_path, model_cache, algo), "kl")
    ref0 = IterationRef(0, 0, 0)
    session.collect(ref0, horizon=1)
    session.advantages(ref0)
    upd = session.update(ref0)
    assert "kl" not in upd  # not a loss term
    assert ("old_logprob_abs_diff" in upd) == recompute
    ref = IterationRef(0, 1, 1)  # the policy moved: pi_old != pi_ref now
    session.collect(ref, horizon=1)
    calls = _spy(session)
    out = session.advantages(ref)
    assert calls == [sorted(["ref_logprobs"] + (["logprobs"] if recompute else []))]
    episodes, batch, rewards, _, by_id = _layout(session, ref)
    got = session.trainer.compute(batch, ["ref_logprobs", "logprobs"])
    old = got["logprobs"] if recompute else batch.old_logprobs
    kl = A.kl_penalty(old, got["ref_logprobs"], "k3") * batch.loss_mask
    assert out["kl"] == pytest.approx(float(A.masked_mean(kl, batch.loss_mask)), rel=1e-5) and out["kl"] > 1e-4
    token_rewards = A.place_outcome_reward(rewards, batch.loss_mask) - 0.5 * kl
    _assert_table(episodes, by_id, *A.compute_advantages("reinforce_pp", token_rewards, batch.loss_mask, gamma=0.95))


# -- turn-level credit -----------------------------------------------------------------------
@pytest.mark.parametrize("algo", [
    {"estimator": "grpo", "credit": "turn", "turn_gamma": 0.9},
    {"estimator": "rloo", "credit": "turn", "turn_baseline": "turn"},
    {"estimator": "reinforce_pp", "credit": "turn", "kl_coef": 0.2, "kl_in_reward": True},
    {"estimator": "gae", "credit": "turn", "critic": {"model": "shared"}},
    {"estimator": "grpo", "credit": "turn", "turn_baseline": "state", "turn_gamma": 0.95,
     "step_advantage_weight": 0.5},
], ids=["grpo", "rloo-turn-baseline", "reinforce_pp-kl", "gae-shared", "grpo-state"])
def test_turn_credit_uses_each_turns_reward(tmp_path, model_cache, monkeypatch, algo):
    multiturn_env.install(monkeypatch)
    cfg = _cfg(tmp_path, model_cache, algo, multi=True)
    session = PolicySession(cfg, "turns")
    ref = IterationRef(0, 0, 0)
    session.collect(ref, horizon=3)
    session.advantages(ref)
    episodes, batch, rewards, groups, by_id = _layout(session, ref)
    assert max(e.num_turns for e in episodes) == 3
    turn_r = torch.tensor([[t.reward for t in e.turns] + [0.0] * (3 - e.num_turns) for e in episodes])
    turn_m = torch.tensor([[1] * e.num_turns + [0] * (3 - e.num_turns) for e in episodes])
    torch.testing.assert_close(turn_r.sum(1), rewards)  # the turns' rewards add up to the outcome
    mask = batch.loss_mask
    penalty = torch.zeros_like(mask)
    if algo.get("kl_in_reward"):
        got = session.trainer.compute(batch, ["ref_logprobs"])
        penalty = -0.2 * A.kl_penalty(batch.old_logprobs, got["ref_logprobs"], "k3") * mask
    if algo["estimator"] == "gae":
        values = session.trainer.compute(batch, ["values"])["values"]
        want = A.compute_advantages("gae", A.place_rewards_on_turn_ends(turn_r, turn_m, mask), mask, values=values)
    else:
        # the state each turn acted in: the observation's digest (this env gives no state_key)
        keys = {}
        sid = torch.tensor([[keys.setdefault(rollout.state_key(t.observation, None), len(keys)) for t in e.turns]
                            + [0] * (3 - e.num_turns) for e in session.store.read_episodes(0, 0)])
        want = A.turn_credit_advantages(
            algo["estimator"], turn_r + A.turn_sums(penalty, turn_m, mask), turn_m, mask, groups,
            turn_gamma=algo.get("turn_gamma", 1.0), baseline=algo.get("turn_baseline", "turn"),
            state_ids=sid, step_advantage_weight=algo.get("step_advantage_weight", 1.0))
        if algo.get("turn_baseline") == "state":  # some turns share a state: step groups exist
            assert len(keys) < int(turn_m.sum())
    _assert_table(episodes, by_id, *want)
    assert session.update(ref)["updated"]


@pytest.mark.parametrize("credit", ["outcome", "turn"])
def test_invalid_action_penalty_shapes_only_what_the_estimator_compares(tmp_path, model_cache, monkeypatch, credit):
    """Each wasted turn (format error or invalid action) costs ``invalid_action_penalty`` in the
    score GRPO compares (outcome) or in that turn's reward (turn); stored rewards stay as played."""
    from agentgym.pipeline import episode_scores, wasted_turns

    multiturn_env.install(monkeypatch)
    cfg = _cfg(tmp_path, model_cache, {"estimator": "grpo", "credit": credit, "invalid_action_penalty": 0.25},
               multi=True)
    cfg.envs[0].kwargs["flag_invalid"] = True
    session = PolicySession(cfg, f"shaped-{credit}")
    ref = IterationRef(0, 0, 0)
    session.collect(ref, horizon=3)
    session.advantages(ref)
    episodes, batch, rewards, groups, by_id = _layout(session, ref)
    wasted = torch.tensor([float(wasted_turns(e)) for e in episodes])
    assert wasted.sum() > 0, "the tiny model should waste some turns"
    torch.testing.assert_close(episode_scores(episodes, 0.25), rewards - 0.25 * wasted)
    mask = batch.loss_mask
    if credit == "outcome":
        want = A.compute_advantages("grpo", A.place_outcome_reward(rewards - 0.25 * wasted, mask), mask, groups)
    else:
        turn_r = torch.tensor([[t.reward - 0.25 * (t.format_error or t.invalid_action) for t in e.turns]
                               + [0.0] * (3 - e.num_turns) for e in episodes])
        turn_m = torch.tensor([[1] * e.num_turns + [0] * (3 - e.num_turns) for e in episodes])
        want = A.turn_credit_advantages("grpo", turn_r, turn_m, mask, groups, baseline="turn")
    _assert_table(episodes, by_id, *want)
    stored = session.store.read_table("turns", stage=0, iteration=0)
    assert stored.invalid_action.sum() == sum(t.invalid_action for e in episodes for t in e.turns)
    assert (stored.reward >= 0).all()  # rewards are stored as played, unshaped


def test_a_penalty_makes_groups_of_failures_informative():
    from agentgym.pipeline import informative_groups
    from agentgym.types import Episode, Turn

    def episode(gid: str, eid: str, invalid: list[bool]) -> Episode:
        e = Episode(eid, gid, "babyai", 0, 0, 4)
        e.turns = [Turn(k, "", "", None, 0.0, False, False, False, 1, 0.0, invalid_action=bad)
                   for k, bad in enumerate(invalid)]
        return e

    eps = [episode("g", "a", [True, True]), episode("g", "b", [False, True]),
           episode("h", "c", [False]), episode("h", "d", [False])]
    assert informative_groups(eps) == 0  # every episode failed: all tie on reward
    assert informative_groups(eps, 0.1) == 1  # g: a wasted two turns, b one; h still ties


# -- recomputed old log-probs ----------------------------------------------------------------
def test_recomputed_old_logprobs_match_the_engine_closely(tmp_path, model_cache):
    """float32 engine and trainer: the engine's sampling log-probs and the recomputed ones agree
    to float noise (a larger gap means the two disagree about the distribution)."""
    session = PolicySession(_cfg(tmp_path, model_cache, {"recompute_old_logprobs": True}), "recompute")
    ref = IterationRef(0, 0, 0)
    session.collect(ref, horizon=1)
    session.advantages(ref)
    out = session.update(ref)
    assert 0.0 <= out["old_logprob_abs_diff"] < 1e-4


# -- invalid combinations --------------------------------------------------------------------
@pytest.mark.parametrize("algo,fix", [
    ({"estimator": "gae"}, r"needs a critic: set algorithm\.critic\.model to 'separate'"),
    ({"estimator": "rloo", "critic": {"model": "separate"}}, r"uses no critic; set algorithm\.estimator: gae"),
    ({"kl_in_reward": True}, r"needs algorithm\.kl_coef > 0 .*set kl_coef"),
    ({"turn_gamma": 0.9}, r"turn_gamma=0\.9 is only used by credit: turn"),
    ({"estimator": "gae", "critic": {"model": "shared"}, "credit": "turn", "turn_gamma": 0.5},
     r"gae discounts per token with gamma"),
    ({"turn_baseline": "turn"}, r"turn_baseline=turn is only used by credit: turn"),
    ({"estimator": "gae", "critic": {"model": "separate"}, "credit": "turn", "turn_baseline": "turn"},
     r"turn_baseline=turn is only used by credit: turn with grpo, rloo or reinforce_pp"),
    ({"critic": {"model": "value-head"}}, r"algorithm\.critic\.model"),
    ({"estimator": "reinforce_pp", "credit": "turn", "turn_baseline": "state"},
     r"turn_baseline=state .* set estimator: grpo or rloo"),
    ({"credit": "turn", "step_advantage_weight": 0.5}, r"step_advantage_weight=0\.5 is only used by turn_baseline: state"),
    ({"credit": "step"}, r"algorithm\.credit"),
])
def test_invalid_combinations_say_how_to_fix(algo, fix):
    with pytest.raises(ConfigError, match=fix):
        parse_config({"algorithm": algo})


@pytest.mark.parametrize("algo", [
    {"estimator": "gae", "critic": {"model": "separate"}},
    {"estimator": "gae", "critic": {"model": "shared", "value_clip": None}, "credit": "turn", "kl_coef": 0.1,
     "kl_in_reward": True, "recompute_old_logprobs": True},
    {"estimator": "grpo", "credit": "turn", "turn_gamma": 0.9, "turn_baseline": "turn"},
    {"estimator": "rloo", "credit": "turn", "turn_gamma": 0.95, "turn_baseline": "state", "step_advantage_weight": 2.0},
    {"estimator": "reinforce_pp", "kl_coef": 0.01, "kl_in_reward": True},
])
def test_valid_combinations_parse(algo):
    cfg = parse_config({"algorithm": algo, "trainer": {"world_size": 2}})  # a critic works at world size > 1 too
    assert cfg.algorithm.estimator.value == algo["estimator"]
