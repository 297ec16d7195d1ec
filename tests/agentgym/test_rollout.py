"""The multi-turn rollout loop: token-in/token-out, masks, horizon, infra faults, seeds."""

import math
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentgym.chat import ChatFormatter
from agentgym.rollout.engines.hf import HFEngine
from agentgym.rollout.loop import EpisodeSpec, RolloutSettings, run_episodes
from env_adapters import make_env
from env_adapters.base import InfraError, StepResult, TextEnv


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def setup(request, tiny_path, tiny_llama3_path):
    path = tiny_path if request.param == "chatml" else tiny_llama3_path
    tok = AutoTokenizer.from_pretrained(path)
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tok)
    return engine, ChatFormatter(tok)


def _specs(n, env="keyword", kwargs=None):
    return [EpisodeSpec(env, i % 2, 0, f"g{i % 2}", f"e{i}", kwargs or {"target": "zzz"}) for i in range(n)]


def test_replies_are_exactly_the_sampled_tokens(setup):
    engine, fmt = setup
    eps = run_episodes(engine, fmt, _specs(4), RolloutSettings(horizon=3, max_new_tokens=6, seed=3), make_env)
    tok = fmt.tokenizer
    for ep in eps:
        assert ep.num_turns == 3 and ep.truncated and not ep.terminated and not ep.infra_error
        sampled = [t for t, m in zip(ep.input_ids, ep.loss_mask) if m == 1]
        # decoding the mask==1 tokens gives back exactly the replies the model generated
        per_turn = []
        i = 0
        while i < len(ep.loss_mask):
            if ep.loss_mask[i] == 1:
                j = i
                while j < len(ep.loss_mask) and ep.loss_mask[j] == 1:
                    j += 1
                per_turn.append(ep.input_ids[i:j])
                i = j
            else:
                i += 1
        assert len(per_turn) == 3
        assert [fmt.reply_text(ids) for ids in per_turn] == [t.action_text for t in ep.turns]
        assert sum(len(x) for x in per_turn) == len(sampled) == sum(t.gen_tokens for t in ep.turns)
        for lp, m in zip(ep.old_logprobs, ep.loss_mask):
            assert (lp != 0.0) == (m == 1) or (m == 1 and lp == 0.0)
        assert all(lp < 0 for lp, m in zip(ep.old_logprobs, ep.loss_mask) if m == 1)


def test_same_seed_same_episodes(setup):
    engine, fmt = setup
    s = RolloutSettings(horizon=2, max_new_tokens=6, seed=11)
    a = run_episodes(engine, fmt, _specs(3), s, make_env)
    b = run_episodes(engine, fmt, _specs(3), s, make_env)
    assert [e.input_ids for e in a] == [e.input_ids for e in b]


def test_success_terminates_and_scores(setup):
    engine, fmt = setup
    fmt2 = ChatFormatter(fmt.tokenizer, response_prefix="yes")  # forced prefix always succeeds
    eps = run_episodes(engine, fmt2, _specs(2, kwargs={"target": "yes"}),
                       RolloutSettings(horizon=4, max_new_tokens=4), make_env)
    for ep in eps:
        assert ep.terminated and not ep.truncated and ep.success and ep.reward == 1.0 and ep.num_turns == 1


def test_context_limit_truncates(setup):
    engine, fmt = setup
    eps = run_episodes(engine, fmt, _specs(2), RolloutSettings(horizon=50, max_new_tokens=8,
                                                               max_context_tokens=120), make_env)
    for ep in eps:
        assert ep.truncated and ep.num_turns < 50 and len(ep.input_ids) <= 120


class _Flaky(TextEnv):
    """Crashes (infra fault) on task 1's second step; task 0 behaves."""

    name = "flaky"

    def reset(self, task_id, seed=0):
        self.task, self.n = task_id, 0
        return "start", {}

    def step(self, action_text):
        self.n += 1
        if self.task == 1 and self.n == 2:
            raise InfraError("server went away")
        return StepResult("again", 0.0, False)


class _Slow(TextEnv):
    name = "slow"
    active = 0
    peak = 0
    lock = threading.Lock()

    def reset(self, task_id, seed=0):
        return "start", {}

    def step(self, action_text):
        with _Slow.lock:
            _Slow.active += 1
            _Slow.peak = max(_Slow.peak, _Slow.active)
        time.sleep(0.5)  # long enough that all live episodes' steps overlap on a loaded machine
        with _Slow.lock:
            _Slow.active -= 1
        return StepResult("ok", 0.0, False)


def test_infra_error_marks_episode_and_rest_completes(setup):
    engine, fmt = setup
    specs = [EpisodeSpec("flaky", t, 0, f"g{t}", f"e{t}-{i}") for t in (0, 1) for i in range(2)]
    eps = run_episodes(engine, fmt, specs, RolloutSettings(horizon=3, max_new_tokens=4),
                       lambda name, **kw: _Flaky())
    bad = [e for e in eps if e.task_id == 1]
    good = [e for e in eps if e.task_id == 0]
    assert all(e.infra_error and "server went away" in e.error and math.isnan(e.reward) for e in bad)
    assert all(not e.infra_error and e.num_turns == 3 for e in good)


class _BrokenReward(TextEnv):
    """Answers the second step of task 1 with a reward of NaN, of task 2 with Inf and of task 3
    with None; task 0 behaves."""

    name = "broken-reward"
    BAD = {1: float("nan"), 2: float("inf"), 3: None}

    def reset(self, task_id, seed=0):
        self.task, self.n = task_id, 0
        return "start", {}

    def step(self, action_text):
        self.n += 1
        if self.task in self.BAD and self.n == 2:
            return StepResult("ok", self.BAD[self.task], False)
        return StepResult("again", 0.0, False)


def test_non_finite_reward_is_an_infra_error_never_a_zero(setup):
    """Clipping to [0, 1] made NaN a 0 (a failure) and Inf a 1 (a success): a broken env must
    instead leave its episode unscored, like a crash."""
    engine, fmt = setup
    specs = [EpisodeSpec("broken-reward", t, 0, f"g{t}", f"e{t}") for t in range(4)]
    eps = {e.task_id: e for e in run_episodes(engine, fmt, specs, RolloutSettings(horizon=3, max_new_tokens=4),
                                              lambda name, **kw: _BrokenReward())}
    assert not eps[0].infra_error and eps[0].reward == 0.0 and eps[0].num_turns == 3
    for t in (1, 2):
        assert eps[t].infra_error and "non-finite reward" in eps[t].error, eps[t].error
        assert math.isnan(eps[t].reward) and not eps[t].success
    assert eps[3].infra_error and "not a number" in eps[3].error


def test_env_steps_run_concurrently(setup):
    engine, fmt = setup
    specs = [EpisodeSpec("slow", 0, 0, "g", f"e{i}") for i in range(8)]
    _Slow.peak = 0
    run_episodes(engine, fmt, specs, RolloutSettings(horizon=2, max_new_tokens=2, env_workers=8),
                 lambda name, **kw: _Slow())
    assert _Slow.peak == 8  # counted, not timed: all 8 episodes' steps were inside the env at once


class _Running(TextEnv):
    """Reports a running score (like SciWorld): 0.2, 0.5, then 0.4 (a setback)."""

    name = "running"

    def reset(self, task_id, seed=0):
        self.k = 0
        return "start", {}

    def step(self, action_text):
        score = [0.2, 0.5, 0.4][self.k]
        self.k += 1
        return StepResult("ok", score, self.k == 3, False, {"reward_is_cumulative": True})


def test_running_score_outcome_is_last_value_and_turns_add_up(setup):
    engine, fmt = setup
    eps = run_episodes(engine, fmt, [EpisodeSpec("running", 0, 0, "g", "e0")],
                       RolloutSettings(horizon=5, max_new_tokens=3), lambda name, **kw: _Running())
    ep = eps[0]
    assert ep.reward == pytest.approx(0.4) and ep.terminated
    assert [round(t.reward, 6) for t in ep.turns] == [0.2, 0.3, -0.1]
    assert sum(t.reward for t in ep.turns) == pytest.approx(ep.reward)


class _Counting(TextEnv):
    """Counts its steps; terminates at step ``end_at`` or truncates at its own move limit
    ``limit`` (like SciWorld / TextWorldExpress), else runs forever."""

    name = "counting"

    def __init__(self, end_at=None, limit=None):
        self.end_at, self.limit, self.steps = end_at, limit, 0

    def reset(self, task_id, seed=0):
        self.steps = 0
        return "start", {}

    def step(self, action_text):
        self.steps += 1
        ended = self.end_at is not None and self.steps >= self.end_at
        limited = not ended and self.limit is not None and self.steps >= self.limit
        return StepResult(f"step {self.steps}", 1.0 if ended else 0.0, ended, limited,
                          {"success": ended, "step_limit_reached": limited})


@pytest.mark.parametrize("end_at, limit, turns, terminated, truncated", [
    (None, None, 3, False, True),  # the horizon: the rollout truncates the third turn
    (3, None, 3, True, False),     # the task ends exactly at the horizon: terminated, not cut
    (None, 2, 2, False, True),     # the environment's own move limit, before the horizon
])
def test_horizon_is_truncation(setup, end_at, limit, turns, terminated, truncated):
    """The TextEnv never sees the horizon: the rollout loop owns it (env_adapters/base.py).
    Stepping to the horizon without termination makes that turn ``truncated`` (``terminated``
    False), and the environment is never stepped past it."""
    engine, fmt = setup
    envs = []

    def make(name, **kw):
        envs.append(_Counting(end_at, limit))
        return envs[-1]

    ep, = run_episodes(engine, fmt, [EpisodeSpec("counting", 0, 0, "g", "e0")],
                       RolloutSettings(horizon=3, max_new_tokens=3), make)
    assert ep.num_turns == turns and envs[0].steps == turns
    assert [t.truncated for t in ep.turns] == [False] * (turns - 1) + [truncated]
    assert [t.terminated for t in ep.turns] == [False] * (turns - 1) + [terminated]
    assert (ep.terminated, ep.truncated, ep.infra_error) == (terminated, truncated, False)
    assert ep.success is terminated and ep.reward == (1.0 if terminated else 0.0)


def test_constrained_actions_are_always_valid_and_exactly_stored(setup):
    """constrain_actions: every BabyAI reply is one of the valid actions at that turn, in the
    reply format, stored token for token; the multi_char_share env lists no actions and keeps
    free generation in the same batch."""
    import multiturn_env

    engine, fmt = setup
    fmt = ChatFormatter(fmt.tokenizer, "Action:")
    seen: dict[int, list[list[str]]] = {}  # task id -> the valid actions listed at each turn

    def make(name, **kw):
        if name == multiturn_env.NAME:
            return multiturn_env.MultiTurnCharShare(**kw)
        env = make_env(name, **kw)
        orig_reset, orig_list = env.reset, env.valid_actions
        task: list[int] = []

        def reset(task_id, seed=0):
            task.append(task_id)
            return orig_reset(task_id, seed)

        def listed():
            actions = orig_list()
            seen.setdefault(task[-1], []).append(list(actions or []))
            return actions
        env.reset, env.valid_actions = reset, listed
        return env

    specs = [EpisodeSpec("babyai", t, 0, f"g{t}", f"b{t}") for t in (0, 1, 40)]
    specs.append(EpisodeSpec(multiturn_env.NAME, 0, 0, "gm", "m0", {"turns": 2}))
    settings = RolloutSettings(horizon=4, max_new_tokens=8, stop=["\n"], seed=5, constrain_actions=True)
    eps = run_episodes(engine, fmt, specs, settings, make)
    for ep in eps[:3]:
        assert not ep.infra_error and ep.num_turns >= 1
        for turn in ep.turns:
            assert not turn.format_error and not turn.invalid_action, turn
    assert sorted(seen) == [0, 1, 40]
    for ep in eps[:3]:
        replies = [ep.input_ids[i] for i, m in enumerate(ep.loss_mask) if m == 1]
        said = [fmt.action_reply_ids(t.parsed_action, ["\n"]) for t in ep.turns]
        assert replies == [tok for ids in said for tok in ids]  # the chosen candidates' ids, exactly
    for ep in eps[:3]:
        assert all(t.parsed_action in seen[ep.task_id][k] for k, t in enumerate(ep.turns))
    free = eps[3]
    assert free.num_turns == 2 and not free.infra_error and sum(free.loss_mask) > 0
    again = run_episodes(engine, fmt, specs, settings, make)  # seeded: the same choices
    assert [[t.action_text for t in e.turns] for e in again] == [[t.action_text for t in e.turns] for e in eps]


def test_max_live_caps_the_batch_and_streams_episodes_as_they_end(setup):
    """With max_live 2, 5 episodes play at most 2 at a time (queued ones start as others end),
    all finish like uncapped ones would (3 turns, truncated), and iter_episodes hands each one
    out before the rollout is over."""
    from agentgym.rollout.loop import iter_episodes

    engine, fmt = setup
    sizes = []
    real = engine.generate

    def counting(prompts, params, cache_keys=None):
        sizes.append(len(prompts))
        return real(prompts, params, cache_keys=cache_keys)

    engine.generate = counting
    try:
        s = RolloutSettings(horizon=3, max_new_tokens=4, seed=1, max_live=2)
        seen = []
        for ep in iter_episodes(engine, fmt, _specs(5), s, make_env):
            seen.append((ep.episode_id, len(sizes)))
    finally:
        del engine.generate
    assert max(sizes) == 2 and sum(sizes) == 5 * 3  # every episode's 3 turns, 2 rows at a time
    assert sorted(e for e, _ in seen) == [f"e{i}" for i in range(5)]
    assert seen[0][1] < len(sizes)  # the first episode came out while others still played
    # uncapped (0) and a cap above the episode count are the same rollout
    a = run_episodes(engine, fmt, _specs(3), RolloutSettings(horizon=2, max_new_tokens=4, seed=5), make_env)
    b = run_episodes(engine, fmt, _specs(3), RolloutSettings(horizon=2, max_new_tokens=4, seed=5,
                                                             max_live=8), make_env)
    assert [x.input_ids for x in a] == [x.input_ids for x in b]
    assert all(x.num_turns == 2 and x.truncated for x in a)


def test_each_turn_records_the_state_it_acted_in(setup):
    """``Turn.state_key`` is the adapter's ``info["state_key"]`` that came with the turn's
    observation (the reset's for turn 0, the previous step's after), else the observation's
    digest: replaying the stored actions in a fresh BabyAI gives the same keys."""
    from agentgym.rollout.loop import state_key

    engine, fmt = setup
    fmt = ChatFormatter(fmt.tokenizer, "Action:")
    specs = [EpisodeSpec("babyai", t, 0, f"g{t}", f"b{t}") for t in (0, 40)]
    settings = RolloutSettings(horizon=4, max_new_tokens=8, stop=["\n"], seed=3, constrain_actions=True)
    for ep in run_episodes(engine, fmt, specs, settings, make_env):
        twin = make_env("babyai")
        _, info = twin.reset(ep.task_id, ep.seed)
        want = [info["state_key"]]
        for turn in ep.turns[:-1]:
            want.append(twin.step(turn.action_text).info["state_key"])
        assert [t.state_key for t in ep.turns] == want and all(k.startswith("babyai:") for k in want)
    keyword = run_episodes(engine, fmt, _specs(2), RolloutSettings(horizon=2, max_new_tokens=4, seed=1), make_env)
    for ep in keyword:  # the keyword env gives no state_key: the observation's digest
        assert [t.state_key for t in ep.turns] == [state_key(t.observation, None) for t in ep.turns]
        assert all(t.state_key.startswith("obs:") for t in ep.turns)
