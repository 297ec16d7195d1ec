"""The HF engine: seeded, batched with left padding, log-probs of the sampling distribution."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentgym.rollout.engines import SamplingParams
from agentgym.rollout.engines.hf import HFEngine, _top_p_filter, candidate_tree


@pytest.fixture(scope="module")
def engine(tiny_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    return HFEngine(model, AutoTokenizer.from_pretrained(tiny_path))


def _prompts(engine):
    tok = engine.tokenizer
    return [tok("go to the red ball", add_special_tokens=False)["input_ids"],
            tok("craft", add_special_tokens=False)["input_ids"],
            tok("pick up the key and open the door now", add_special_tokens=False)["input_ids"]]


def _full_logprobs(model, prompt, reply, temperature):
    ids = torch.tensor([prompt + reply])
    logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(reply)[:, None]).squeeze(-1)


def test_same_seed_same_tokens(engine):
    p = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7)
    a = engine.generate(_prompts(engine), p)
    b = engine.generate(_prompts(engine), p)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    c = engine.generate(_prompts(engine), SamplingParams(max_new_tokens=12, seed=8))
    assert [s.token_ids for s in a] != [s.token_ids for s in c]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_full_forward(engine, temperature):
    prompts = _prompts(engine)
    samples = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=temperature, seed=1))
    with torch.no_grad():
        for prompt, s in zip(prompts, samples):
            ref = _full_logprobs(engine.model, prompt, s.token_ids, temperature)
            assert torch.allclose(torch.tensor(s.logprobs), ref, atol=1e-4), (s.logprobs, ref)


def test_greedy_batched_equals_single(engine):
    """Left padding and row dropping must not change any row's result."""
    prompts = _prompts(engine)
    p = SamplingParams(max_new_tokens=10, greedy=True)
    batched = engine.generate(prompts, p)
    single = [engine.generate([q], p)[0] for q in prompts]
    assert [s.token_ids for s in batched] == [s.token_ids for s in single]


def test_stop_token_ends_reply(engine):
    prompts = _prompts(engine)
    free = engine.generate(prompts, SamplingParams(max_new_tokens=10, greedy=True))
    stop = free[0].token_ids[2]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=10, greedy=True, stop_token_ids=[stop]))
    assert out[0].token_ids == free[0].token_ids[: free[0].token_ids.index(stop) + 1]
    assert out[0].finish_reason == "stop"
    assert all(len(s.token_ids) <= 10 for s in out)


def test_update_weights_changes_outputs(engine, tiny_path):
    other = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    p = SamplingParams(max_new_tokens=8, greedy=True)
    before = engine.generate(_prompts(engine), p)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    saved = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.update_weights(other.named_parameters())
    after = engine.generate(_prompts(engine), p)
    engine.model.load_state_dict(saved)
    assert [s.token_ids for s in before] != [s.token_ids for s in after]
    with pytest.raises(KeyError):
        engine.update_weights([("nope", torch.zeros(1))])


def test_top_p_keeps_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = _top_p_filter(probs, 0.7)
    assert torch.allclose(out, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


def _same_conversations(a_engine, b_engine, convs, keys, params, observation, turns: int = 3) -> None:
    """Play ``turns`` turns of the same conversations on both engines (cache keys kept): same
    tokens and log-probs each turn. ``observation(turn, row)`` is the text appended after each
    reply, of a different length per row."""
    tok = a_engine.tokenizer
    for turn in range(turns):
        a = a_engine.generate(convs, params, cache_keys=keys)
        b = b_engine.generate(convs, params, cache_keys=keys)
        assert [s.token_ids for s in a] == [s.token_ids for s in b]
        for sa, sb in zip(a, b):
            assert torch.allclose(torch.tensor(sa.logprobs), torch.tensor(sb.logprobs), atol=1e-4)
        obs = [tok(observation(turn, k), add_special_tokens=False)["input_ids"] for k in range(len(convs))]
        convs = [c + s.token_ids + o for c, s, o in zip(convs, a, obs)]


def test_kept_cache_across_turns_matches_full_prefill(tiny_path):
    """Turn 2 reuses turn 1's keys/values: same tokens and log-probs as prefilling everything."""
    tok = AutoTokenizer.from_pretrained(tiny_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    cached, fresh = HFEngine(model, tok, keep_cache=True), HFEngine(model, tok, keep_cache=False)
    keys = ["a", "b", "c"]
    _same_conversations(cached, fresh, [list(x) for x in _prompts(cached)], keys,
                        SamplingParams(max_new_tokens=6, seed=5),
                        lambda turn, k: f"observation {turn} " * (k + 1))
    assert cached.prefilled_tokens < fresh.prefilled_tokens / 2
    cached.release(keys)
    assert not cached._prefixes


def test_stop_string_ignores_leading_whitespace(engine):
    tok = engine.tokenizer
    nl = tok("\n", add_special_tokens=False)["input_ids"]
    word = tok(" go", add_special_tokens=False)["input_ids"]
    assert not engine._stopped_by_string(nl, ["\n"])
    assert engine._stopped_by_string(nl + word + nl, ["\n"])


def test_length_groups_bound_the_padding():
    from agentgym.rollout.engines.hf import length_groups

    lengths = [372, 100, 360, 120, 250, 101, 99, 371]
    groups = length_groups(lengths, 0.1)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        longest = max(lengths[i] for i in g)
        assert longest * len(g) - sum(lengths[i] for i in g) <= 0.1 * longest * len(g)
    assert len(groups) == 3  # {372, 371, 360}, {250}, {120, 101, 100, 99}
    assert length_groups(lengths, 1.0) == [sorted(range(8), key=lambda i: -lengths[i])]


def test_grouped_prefill_matches_one_padded_batch(tiny_path):
    """Prefilling rows in length groups and merging their caches gives the tokens and log-probs
    of one padded batch, over several turns of kept caches."""
    tok = AutoTokenizer.from_pretrained(tiny_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    grouped = HFEngine(model, tok, keep_cache=True, max_padding=0.0)  # every distinct length alone
    one = HFEngine(model, tok, keep_cache=True, max_padding=1.0)
    convs = [tok("go " * (3 * k + 1), add_special_tokens=False)["input_ids"] for k in range(4)]
    _same_conversations(grouped, one, convs, ["a", "b", "c", "d"], SamplingParams(max_new_tokens=5, seed=3),
                        lambda turn, k: f"seen {turn} " * (2 * (3 - k) + 1))
    assert grouped.prefilled_tokens == one.prefilled_tokens


# ------------------------------------------------------------------- action-constrained decoding
def _candidates(engine):
    tok = engine.tokenizer
    words = ["turn left", "turn right", "go to red ball 1", "pickup", "move forward and then left"]
    return [tok(" " + w + "\n", add_special_tokens=False)["input_ids"] for w in words]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_choice_logprobs_match_full_forward(engine, temperature):
    """Each candidate's score is its log-likelihood under a plain forward over prompt + candidate
    (a second implementation, no cache, no batching), and greedy picks the largest."""
    prompts = _prompts(engine)  # of different lengths: one padded batch, left pads masked
    cands = _candidates(engine)
    cands.append(cands[2][:3])  # a candidate that is a prefix of another one
    # rows with different candidate sets (trees of different sizes, one of single tokens only)
    choices = [cands, cands[:2], [c[:1] for c in cands[:3]]] + [cands[::-1]] * (len(prompts) - 3)
    with torch.no_grad():
        logits, cache, attn, _ = engine._prefill(prompts, None)
        first = torch.log_softmax(logits / temperature, -1)
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        for chunk in (1 << 26, 1):  # all rows in one forward; one row per forward
            engine.max_scoring_logits = chunk
            got = engine._candidate_logprobs(cache, attn, first, choices, temperature)
            for p, row_cands, row in zip(prompts, choices, got):
                for c, lps in zip(row_cands, row):
                    ref = _full_logprobs(engine.model, p, c, temperature)
                    assert torch.allclose(torch.tensor(lps), ref, atol=1e-4), (lps, ref)
        del engine.max_scoring_logits
        assert all(torch.equal(layer.keys, k) and torch.equal(layer.values, v)
                   for layer, (k, v) in zip(cache.layers, before))  # the prompts' cache untouched
        picked = engine.choose(prompts, choices, SamplingParams(greedy=True, temperature=temperature))
        for row_cands, row, s in zip(choices, got, picked):
            best = max(range(len(row_cands)), key=lambda i: sum(row[i]))
            assert s.token_ids == row_cands[best] and s.finish_reason == "stop"
            assert s.logprobs == pytest.approx(row[best], abs=1e-5)


def test_candidate_tree_feeds_each_shared_prefix_once():
    tokens, parents, index = candidate_tree([[5, 6, 7], [5, 6, 8, 9], [5, 2], [4]])
    # proper prefixes: (5,), (5,6), (5,6,8) -- [4] and the last tokens are never fed
    assert tokens == [5, 6, 8] and parents == [-1, 0, 1]
    assert index == {(5,): 0, (5, 6): 1, (5, 6, 8): 2}


def _chi2(counts, expected):
    return sum((c - e) ** 2 / e for c, e in zip(counts, expected))


def test_choice_samples_in_proportion_to_likelihood(engine):
    """Over many seeds the chosen candidate's frequency follows softmax(sequence log-likelihood)
    (conditioning the policy on the candidate set): chi-square against the closed form."""
    prompt = _prompts(engine)[1]
    p = SamplingParams(temperature=1.0)
    # a single candidate is always chosen and reports its own log-probs: its sequence score
    score = {tuple(c): sum(engine.choose([prompt], [[c]], p)[0].logprobs) for c in _candidates(engine)}
    cands = [list(c) for c in sorted(score, key=score.get)[-2:]]  # the two likeliest: both get hits
    scores = [score[tuple(c)] for c in cands]
    greedy = engine.choose([prompt], [cands], SamplingParams(greedy=True))[0]
    probs = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
    assert greedy.token_ids == cands[int(probs.argmax())]
    n = 600
    counts = [0, 0]
    batch = [prompt] * n  # one call, n rows: one generator draws them in order
    for s in engine.choose(batch, [cands] * n, SamplingParams(seed=3)):
        counts[cands.index(s.token_ids)] += 1
    expected = [float(q) * n for q in probs]
    assert min(expected) > 5, expected
    assert _chi2(counts, expected) < 10.83, (counts, expected)  # p = 0.001 for 1 degree of freedom
    again = engine.choose(batch[:20], [cands] * 20, SamplingParams(seed=3))
    assert [s.token_ids for s in again] == [s.token_ids for s in engine.choose(
        batch[:20], [cands] * 20, SamplingParams(seed=3))]


def test_a_choice_temperature_samples_the_tempered_likelihood(engine):
    """choice_temperature t (rollout.action_temperature): frequencies follow softmax(score / t),
    not softmax(score); greedy is unchanged."""
    prompt = _prompts(engine)[1]
    score = {tuple(c): sum(engine.choose([prompt], [[c]], SamplingParams())[0].logprobs) for c in _candidates(engine)}
    ranked = sorted(score, key=score.get)
    cands = [list(ranked[-1]), list(ranked[len(ranked) // 2])]  # the likeliest and a middling one
    scores = torch.tensor([score[tuple(c)] for c in cands], dtype=torch.float64)
    t, n = 3.0, 600
    counts = [0, 0]
    for s in engine.choose([prompt] * n, [cands] * n, SamplingParams(seed=5, choice_temperature=t)):
        counts[cands.index(s.token_ids)] += 1
    tempered = [float(q) * n for q in torch.softmax(scores / t, 0)]
    plain = [float(q) * n for q in torch.softmax(scores, 0)]
    assert _chi2(counts, tempered) < 10.83, (counts, tempered)
    assert _chi2(counts, plain) > 10.83, (counts, plain)  # the temperature was applied
    greedy = engine.choose([prompt], [cands], SamplingParams(greedy=True, choice_temperature=t))[0]
    assert greedy.token_ids == cands[0]


def test_choice_keeps_the_conversation_cache(tiny_path):
    """After a chosen reply, the next turn prefills only the new tokens and generates exactly
    what an engine without a kept cache generates."""
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_path)
    kept, fresh = HFEngine(model, tok), HFEngine(model, tok, keep_cache=False)
    prompts = _prompts(kept)
    cands = _candidates(kept)
    keys = [f"ep{i}" for i in range(len(prompts))]
    p = SamplingParams(greedy=True, max_new_tokens=6)
    a = kept.choose(prompts, [cands] * len(prompts), p, cache_keys=keys)
    b = fresh.choose(prompts, [cands] * len(prompts), p, cache_keys=keys)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    obs = tok(" you see a wall", add_special_tokens=False)["input_ids"]
    nxt = [q + s.token_ids + obs for q, s in zip(prompts, a)]
    before = kept.prefilled_tokens
    x = kept.generate(nxt, p, cache_keys=keys)
    assert kept.prefilled_tokens - before == sum(len(s.token_ids) + len(obs) for s in a)
    y = fresh.generate(nxt, p, cache_keys=keys)
    assert [s.token_ids for s in x] == [s.token_ids for s in y]
    for s, t in zip(x, y):
        assert s.logprobs == pytest.approx(t.logprobs, abs=1e-4)


def test_choice_rejects_empty_candidates(engine):
    with pytest.raises(ValueError, match="non-empty"):
        engine.choose(_prompts(engine)[:1], [[]], SamplingParams())


def test_choice_reuses_the_cache_when_the_caller_extends_its_prompt_in_place(tiny_path):
    """The rollout passes each episode's own ``input_ids`` list and appends the reply and the
    next observation to it in place: the next turn must still prefill only the new tokens (a
    kept prefix stored by reference grew with the list and was never reused)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_path)
    kept, fresh = HFEngine(model, tok), HFEngine(model, tok, keep_cache=False)
    convs = _prompts(kept)  # mutated in place below, as the rollout does
    cands = _candidates(kept)
    keys = [f"ep{i}" for i in range(len(convs))]
    obs = tok(" you see a wall", add_special_tokens=False)["input_ids"]
    p = SamplingParams(greedy=True)
    for turn in range(3):
        before = kept.prefilled_tokens
        ref = fresh.choose([list(c) for c in convs], [cands] * len(convs), p)
        got = kept.choose(convs, [cands] * len(convs), p, cache_keys=keys)
        assert [s.token_ids for s in got] == [s.token_ids for s in ref]
        for s, t in zip(got, ref):
            assert s.logprobs == pytest.approx(t.logprobs, abs=1e-4)
        if turn:  # only the previous reply and observation, plus the candidate trees
            trees = sum(len(candidate_tree(cands)[0]) for _ in convs)
            assert kept.prefilled_tokens - before == sum(len(s.token_ids) + len(obs) for s in last) + trees
        for c, s in zip(convs, got):
            c.extend(s.token_ids + obs)
        last = got


def test_reserved_layer_holds_what_a_dynamic_layer_holds_without_copying_per_token():
    """``ReservedLayer`` (decode steps write into spare room) against transformers' own
    ``DynamicLayer`` (``torch.cat`` per step) over prefill, decode steps past the reserve, and a
    batch selection; within the reserve a step writes in place (same buffer)."""
    from transformers.cache_utils import DynamicLayer

    from agentgym.rollout.engines.hf import ReservedLayer

    g = torch.Generator().manual_seed(0)
    kv = lambda n, t: (torch.randn(2, 3, t, 4, generator=g), torch.randn(2, 3, t, 4, generator=g))  # noqa: E731
    ref, ours = DynamicLayer(), ReservedLayer(reserve=3)
    for t in [5, 1, 1]:  # prefill, then decode steps inside the reserve
        k, v = kv(2, t)
        ref.update(k, v)
        ours.update(k, v)
    buffer = ours._k.data_ptr()
    k, v = kv(2, 1)
    ref.update(k, v), ours.update(k, v)
    assert ours._k.data_ptr() == buffer  # no copy of the cache for a token that fits
    for _ in range(4):  # past the reserve: grows
        k, v = kv(2, 1)
        ref.update(k, v), ours.update(k, v)
    assert torch.equal(ref.keys, ours.keys) and torch.equal(ref.values, ours.values)
    assert ours.get_seq_length() == ref.get_seq_length() == 12
    keep = torch.tensor([1])
    ref.batch_select_indices(keep), ours.batch_select_indices(keep)
    k, v = (x[:1] for x in kv(2, 1))
    ref.update(k, v), ours.update(k, v)
    assert torch.equal(ref.keys, ours.keys) and torch.equal(ref.values, ours.values)


def test_identical_prompts_are_prefilled_and_scored_once(tiny_path):
    """A GRPO group's copies share their prompt: prefill runs once per distinct prompt and the
    candidate trees once per distinct (prompt, candidates); every row still gets what it would
    get alone, and ``generate`` still samples each copy on its own."""
    tok = AutoTokenizer.from_pretrained(tiny_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    engine = HFEngine(model, tok)
    p, cands = _prompts(engine), _candidates(engine)
    prompts = [p[0], p[1], p[0], p[0]]
    choices = [cands, cands, cands, cands[:2]]  # the last: same prompt, other candidates
    params = SamplingParams(greedy=True)
    got = engine.choose(prompts, choices, params)
    for prompt, row_choices, sample in zip(prompts, choices, got):
        alone = HFEngine(model, tok).choose([prompt], [row_choices], params)[0]
        assert sample.token_ids == alone.token_ids
        assert torch.allclose(torch.tensor(sample.logprobs), torch.tensor(alone.logprobs), atol=1e-5)
    nodes = lambda c: len(candidate_tree(c)[0])  # noqa: E731
    assert engine.prefilled_tokens == len(p[0]) + len(p[1]) + 2 * nodes(cands) + nodes(cands[:2])

    engine = HFEngine(model, tok)
    samples = engine.generate([p[2]] * 4, SamplingParams(max_new_tokens=8, seed=3))
    assert engine.prefilled_tokens == len(p[2])
    assert len({tuple(s.token_ids) for s in samples}) > 1  # the copies sample independently
    for s in samples:
        assert torch.allclose(torch.tensor(s.logprobs), _full_logprobs(model, p[2], s.token_ids, 1.0), atol=1e-4)
