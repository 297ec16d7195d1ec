"""Sampling seeded per (episode, turn) (``RolloutSettings.seeds_per_episode``,
``SamplingParams.row_seeds``): an episode's replies do not depend on the batch it plays in, so
N rollout workers play the same episodes as one; the per-call default is the old stream."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentgym.chat import ChatFormatter
from agentgym.rollout.engines import SamplingParams
from agentgym.rollout.engines.hf import HFEngine, _top_p_filter
from agentgym.rollout.engines.vllm_rules import Piece, generate_with_stop_rule, request_fields, row_seed
from agentgym.rollout.loop import EpisodeSpec, RolloutSettings, episode_turn_seed, run_episodes, turn_seed
from env_adapters import make_env


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def engine(request, tiny_path, tiny_llama3_path):
    path = tiny_path if request.param == "chatml" else tiny_llama3_path
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return HFEngine(model, AutoTokenizer.from_pretrained(path))


def _prompts(engine: HFEngine) -> list[list[int]]:
    tok = engine.tokenizer
    texts = ["go to the red ball", "craft", "pick up the key and open the door now", "craft", "toggle"]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def _with_stops(engine: HFEngine, prompts: list[list[int]], p: SamplingParams) -> SamplingParams:
    """``p`` with two stop ids that rows 0 and 2 sample early under ``p`` (their 3rd and 5th
    tokens), so that rows leave the batch at different steps."""
    free = engine.generate(prompts, p)
    return replace(p, stop_token_ids=[free[0].token_ids[2], free[2].token_ids[4]])


def _candidates(engine: HFEngine) -> list[list[int]]:
    tok = engine.tokenizer
    return [tok(c, add_special_tokens=False)["input_ids"] for c in [" go", " go to", " pick up", " toggle", " drop it"]]


def _same(a, b, atol=1e-5):
    """Same token ids and log-probs within ``atol``, sample for sample."""
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    for x, y in zip(a, b):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=atol, rtol=0)


# -- engine ----------------------------------------------------------------------------------


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_row_seeds_draw_a_rows_tokens_alone_or_beside_others(engine, top_p):
    """With row_seeds, a row's reply is the same alone in a call, in a batch (padding, rows
    leaving at different steps, a duplicate prompt prefilled once) or at another row."""
    prompts = _prompts(engine)
    seeds = [11, 22, 33, 44, 55]
    p = _with_stops(engine, prompts, SamplingParams(max_new_tokens=12, temperature=0.8, top_p=top_p,
                                                    row_seeds=seeds))
    batched = engine.generate(prompts, p)
    assert len({len(s.token_ids) for s in batched}) > 1  # rows left the batch at different steps
    alone = [engine.generate([q], replace(p, row_seeds=[s]))[0]
             for q, s in zip(prompts, seeds)]
    _same(batched, alone)
    order = [3, 0, 4, 2, 1]
    shuffled = engine.generate([prompts[i] for i in order],
                               replace(p, row_seeds=[seeds[i] for i in order]))
    _same(shuffled, [batched[i] for i in order])
    # the per-call seed plays no part; a row's own seed does
    other = engine.generate(prompts, replace(p, seed=99, row_seeds=seeds))
    _same(other, batched, atol=0.0)
    assert batched[1].token_ids != batched[3].token_ids  # same prompt, own seeds: own replies


def test_row_seeds_choose_a_rows_candidate_alone_or_beside_others(engine):
    prompts = _prompts(engine) * 4
    cands = _candidates(engine)
    seeds = list(range(100, 100 + len(prompts)))
    batched = engine.choose(prompts, [cands] * len(prompts), SamplingParams(row_seeds=seeds))
    alone = [engine.choose([q], [cands], SamplingParams(row_seeds=[s]))[0] for q, s in zip(prompts, seeds)]
    _same(batched, alone)
    assert len({tuple(s.token_ids) for s in batched}) > 1  # rows draw from their own streams


def test_row_seeds_must_match_the_prompts(engine):
    prompts = _prompts(engine)
    with pytest.raises(ValueError, match="row_seeds"):
        engine.generate(prompts, SamplingParams(max_new_tokens=2, row_seeds=[1, 2]))
    with pytest.raises(ValueError, match="row_seeds"):
        engine.choose(prompts, [_candidates(engine)] * len(prompts), SamplingParams(row_seeds=[1]))


def _reference_generate(model, prompts, params: SamplingParams) -> list[list[int]]:
    """The per-call stream, written out: every step, the rows still going (original order) draw
    their tokens with one ``torch.multinomial`` from one generator seeded with ``params.seed``;
    logits from a full forward of each row alone (no cache, no padding)."""
    gen = torch.Generator(device="cpu").manual_seed(params.seed)
    out: list[list[int]] = [[] for _ in prompts]
    alive = list(range(len(prompts)))
    for _ in range(params.max_new_tokens):
        logits = torch.cat([model(torch.tensor([prompts[r] + out[r]])).logits[:, -1].float() for r in alive])
        probs = _top_p_filter(torch.softmax(logits / params.temperature, -1), params.top_p)
        tok = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        for r, t in zip(alive, tok.tolist()):
            out[r].append(t)
        alive = [r for r in alive if out[r][-1] not in params.stop_token_ids]
        if not alive:
            break
    return out


def test_without_row_seeds_one_generator_draws_the_whole_call(engine):
    """``row_seeds`` None (per_call, the default) is the engine's stream as it always was: one
    generator per call drawing every step's remaining rows together, whatever the batch."""
    prompts = _prompts(engine)
    for p in (_with_stops(engine, prompts, SamplingParams(max_new_tokens=10, seed=7)),
              SamplingParams(max_new_tokens=10, seed=3, temperature=0.7, top_p=0.8)):
        got = engine.generate(prompts, p)
        with torch.no_grad():
            assert [s.token_ids for s in got] == _reference_generate(engine.model, prompts, p)
    # choose: one generator draws the rows' picks in row order
    cands = _candidates(engine)
    rows = prompts * 3
    got = engine.choose(rows, [cands] * len(rows), SamplingParams(seed=4))
    scores = [[sum(engine.choose([q], [[c]], SamplingParams())[0].logprobs) for c in cands] for q in prompts]
    gen = torch.Generator(device="cpu").manual_seed(4)
    ref = [cands[int(torch.multinomial(torch.softmax(torch.tensor(scores[i % len(prompts)], dtype=torch.float64), 0),
                                       1, generator=gen))] for i in range(len(rows))]
    assert [s.token_ids for s in got] == ref


# -- vLLM request seeds (no vllm import) -------------------------------------------------------


def test_vllm_request_seeds_come_from_the_row_seeds():
    per_call = SamplingParams(seed=5)
    assert [request_fields(per_call, r, 8, salt)["seed"] for r, salt in [(0, 0), (3, 0), (3, 2)]] == \
        [row_seed(5, 0, 0), row_seed(5, 3, 0), row_seed(5, 3, 2)]
    per_row = SamplingParams(seed=5, row_seeds=[7, 1 << 62, 9])
    # a row's request seed is its own seed's as row 0 of a call, wherever it is in the batch
    assert [request_fields(per_row, r, 8, 1)["seed"] for r in range(3)] == \
        [row_seed(s, 0, 1) for s in (7, 1 << 62, 9)]
    assert request_fields(SamplingParams(row_seeds=[9]), 0, 8)["seed"] == request_fields(per_row, 2, 8)["seed"]

    seen: list[list[int]] = []

    def run(batch, fields):  # the continued rows (a stop string in leading whitespace) keep their seeds
        seen.append([f["seed"] for f in fields])
        return [Piece([1], [-0.1], "stop", "\n" if len(seen) == 1 and i == 1 else 2) for i in range(len(batch))]

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "\n"

    generate_with_stop_rule([[1], [2], [3]], SamplingParams(max_new_tokens=4, stop_strings=["\n"], row_seeds=[7, 8, 9]),
                            Tok(), run)
    assert seen == [[row_seed(s, 0, 0) for s in (7, 8, 9)], [row_seed(8, 0, 1)]]


# -- rollout ---------------------------------------------------------------------------------


def test_episode_turn_seed_names_the_reply():
    a = episode_turn_seed(5, "e0", 0)
    assert a == episode_turn_seed(5, "e0", 0) and 0 <= a < 1 << 63
    assert len({a, episode_turn_seed(5, "e1", 0), episode_turn_seed(5, "e0", 1), episode_turn_seed(6, "e0", 0)}) == 4


def _group(env: str, task: int, group: str) -> list[EpisodeSpec]:
    return [EpisodeSpec(env, task, 0, group, f"{group}-{k}") for k in range(4)]


def _make(name, **kw):
    import multiturn_env

    if name == multiturn_env.NAME:
        return multiturn_env.MultiTurnCharShare(**kw)
    return make_env(name, **kw)


#: two GRPO groups of 4: free generation, constrained choice, and one group of each (then each
#: batched call is split between ``generate`` and ``choose``)
MODES = {
    "free": (("babyai", 0), ("babyai", 40), False),
    "choose": (("babyai", 0), ("babyai", 40), True),
    "mixed": (("babyai", 0), ("multi_char_share", 0), True),
}


@pytest.mark.parametrize("mode", MODES)
def test_episodes_play_the_same_in_any_batch(engine, mode):
    """seeds_per_episode: specs A..H played in one call, group by group in two calls, or at most
    3 at a time give every episode the same tokens (log-probs within 1e-5); the episodes of a
    group still differ."""
    (env_a, task_a), (env_b, task_b), constrain = MODES[mode]
    fmt = ChatFormatter(engine.tokenizer, "Action:")
    a, b = _group(env_a, task_a, "ga"), _group(env_b, task_b, "gb")
    settings = RolloutSettings(horizon=3, max_new_tokens=8, stop=["\n"], seed=5, constrain_actions=constrain,
                               seeds_per_episode=True)
    together = run_episodes(engine, fmt, a + b, settings, _make)
    apart = run_episodes(engine, fmt, a, settings, _make) + run_episodes(engine, fmt, b, settings, _make)
    capped = run_episodes(engine, fmt, a + b, replace(settings, max_live=3), _make)
    assert all(not e.infra_error and e.num_turns >= 1 for e in together)
    for other in (apart, capped):
        assert [e.episode_id for e in other] == [e.episode_id for e in together]
        assert [e.input_ids for e in other] == [e.input_ids for e in together]
        for x, y in zip(other, together):
            assert torch.allclose(torch.tensor(x.old_logprobs), torch.tensor(y.old_logprobs), atol=1e-5, rtol=0)
    for group in (together[:4], together[4:]):
        distinct = {tuple(e.input_ids) for e in group}
        if constrain and group[0].env == "babyai":  # a few valid actions: two episodes may agree
            assert len(distinct) > 1
        else:
            assert len(distinct) == 4
    if constrain:  # the choices were drawn, not generated
        babyai = [e for e in together if e.env == "babyai"]
        assert all(not t.format_error and not t.invalid_action for e in babyai for t in e.turns)


def test_per_call_seeding_is_the_default(engine):
    """Without seeds_per_episode the loop passes no row seeds, and call k's seed is
    turn_seed(seed, k), as before per-episode seeds existed; with it, every reply's row seed is
    its episode's turn's."""
    fmt = ChatFormatter(engine.tokenizer, "Action:")
    calls: list[tuple[int, list[int] | None, list[str]]] = []

    class Spy:
        def __getattr__(self, name):
            return getattr(engine, name)

        def generate(self, prompts, params, cache_keys=None):
            calls.append((params.seed, params.row_seeds, list(cache_keys)))
            return engine.generate(prompts, params, cache_keys)

    specs = _group("babyai", 0, "ga")
    assert RolloutSettings(horizon=2, max_new_tokens=4).seeds_per_episode is False
    run_episodes(Spy(), fmt, specs, RolloutSettings(horizon=2, max_new_tokens=4, seed=3), make_env)
    assert [(s, r) for s, r, _ in calls] == [(turn_seed(3, 0), None), (turn_seed(3, 1), None)]
    calls.clear()
    run_episodes(Spy(), fmt, specs, RolloutSettings(horizon=2, max_new_tokens=4, seed=3, seeds_per_episode=True),
                 make_env)
    assert [r for _, r, _ in calls] == \
        [[episode_turn_seed(3, k, t) for k in keys] for t, (_, _, keys) in enumerate(calls)]
