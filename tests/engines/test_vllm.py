"""The vLLM engine against the HF reference engine, on CPU (``vllm-cpu``), fp32.

Runs in the separate vLLM env: ``bash scripts/setup_vllm_env.sh`` then
``.venv-vllm/bin/python -m pytest tests/engines/test_vllm.py``. In an env without ``vllm`` (the
main one) the whole module is skipped.

The model is the project's tiny random Qwen2 built with head_dim 32 (``hidden_size=64, heads=2,
kv_heads=1``): vLLM's CPU attention supports head sizes 32, 64, 80, ... only, and the default
tiny model has head_dim 16 (``test_default_tiny_model_is_refused_clearly``).
"""

from __future__ import annotations

import os

# Before vllm is imported: in-process engine core, no thread pinning (other tests share the two
# cores), a small KV cache, quiet logs.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import pytest  # noqa: E402

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed in this env; these tests run in .venv-vllm "
           "(bash scripts/setup_vllm_env.sh && .venv-vllm/bin/python -m pytest tests/engines)",
)

import torch  # noqa: E402

from agentgym.models.folders import load_model  # noqa: E402
from agentgym.rollout.engines import SamplingParams, create_engine  # noqa: E402
from agentgym.rollout.engines.hf import HFEngine  # noqa: E402

ATOL = 1e-4
TEXTS = ["go to the red ball", "craft", "pick up the key and open the door now",
         "Thought: I should go.\n", "hello\n\n", "Action: "]


@pytest.fixture(scope="module")
def engines(hd32_path):
    """(vLLM engine, HF engine) over the same fp32 weights."""
    threads = torch.get_num_threads()
    set_threads = torch.set_num_threads
    vllm_engine, tokenizer = create_engine("vllm", hd32_path, "float32", kv_cache_gb=0.25, max_model_len=1024)
    # vLLM must leave the process as it found it (it re-seeds RNGs, replaces set_num_threads)
    assert torch.set_num_threads is set_threads and torch.get_num_threads() == threads
    model, _ = load_model(hd32_path, "float32")
    yield vllm_engine, HFEngine(model, tokenizer)
    vllm_engine.close()


def _prompts(tok) -> list[list[int]]:
    return [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


def _full_logprobs(model, prompt, reply, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + reply])).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(reply)[:, None]).squeeze(-1)


def _assert_same(a, b):
    """Same tokens and finish reasons; log-probs within ATOL. Returns the largest gap."""
    worst = 0.0
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert x.finish_reason == y.finish_reason
        assert len(y.logprobs) == len(y.token_ids)
        gap = max((abs(u - w) for u, w in zip(x.logprobs, y.logprobs)), default=0.0)
        assert gap < ATOL, gap
        worst = max(worst, gap)
    return worst


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_greedy_matches_hf(engines, temperature):
    v, h = engines
    prompts = _prompts(h.tokenizer)
    p = SamplingParams(max_new_tokens=16, greedy=True, temperature=temperature)
    _assert_same(h.generate(prompts, p), v.generate(prompts, p))


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (0.7, 0.8), (1.0, 0.5)])
def test_sampled_logprobs_are_the_untruncated_tempered_distribution(engines, temperature, top_p):
    """log_softmax(logits / T) at the sampled ids, before top-p: what the trainer recomputes."""
    v, h = engines
    prompts = _prompts(h.tokenizer)
    samples = v.generate(prompts, SamplingParams(max_new_tokens=12, temperature=temperature, top_p=top_p, seed=3))
    for prompt, s in zip(prompts, samples):
        ref = _full_logprobs(h.model, prompt, s.token_ids, temperature)
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=ATOL), (s.logprobs, ref)


def test_same_seed_same_tokens(engines):
    v, h = engines
    prompts = _prompts(h.tokenizer)
    p = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7)
    a, b = v.generate(prompts, p), v.generate(prompts, p)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert [s.logprobs for s in a] == [s.logprobs for s in b]
    c = v.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0, seed=8))
    assert [s.token_ids for s in a] != [s.token_ids for s in c]
    # G copies of one prompt (a GRPO group) must not all sample the same reply
    group = v.generate([prompts[0]] * 6, p)
    assert len({tuple(s.token_ids) for s in group}) > 1


def test_stop_token_ids_match_hf(engines):
    v, h = engines
    prompts = _prompts(h.tokenizer)
    free = h.generate(prompts, SamplingParams(max_new_tokens=12, greedy=True))
    stop = free[0].token_ids[2]
    p = SamplingParams(max_new_tokens=12, greedy=True, stop_token_ids=[stop])
    out = v.generate(prompts, p)
    assert out[0].token_ids == free[0].token_ids[: free[0].token_ids.index(stop) + 1]
    assert out[0].finish_reason == "stop"
    _assert_same(h.generate(prompts, p), out)


def test_eos_does_not_stop_unless_asked(engines):
    """Like the HF engine, only the caller's stop ids end a reply (vLLM's EOS rule is off)."""
    v, h = engines
    eos = h.tokenizer.eos_token_id
    prompts = [ids + [eos] for ids in _prompts(h.tokenizer)]  # the tiny model echoes its input
    p = SamplingParams(max_new_tokens=8, greedy=True)
    ref = h.generate(prompts, p)
    assert any(eos in s.token_ids[:-1] for s in ref)  # the case is really exercised
    _assert_same(ref, v.generate(prompts, p))
    p = SamplingParams(max_new_tokens=8, greedy=True, stop_token_ids=[eos])
    _assert_same(h.generate(prompts, p), v.generate(prompts, p))


@pytest.mark.parametrize("stops", [["\n"], ["o"], ["e", "r"], [" the"], [":"]])
def test_stop_strings_match_hf(engines, stops):
    """Including the rule that a stop string in the reply's leading whitespace does not count
    ("hello\\n\\n" makes the tiny model answer "\\n\\n\\n\\n::::...")."""
    v, h = engines
    prompts = _prompts(h.tokenizer)
    p = SamplingParams(max_new_tokens=12, greedy=True, stop_strings=stops)
    ref = h.generate(prompts, p)
    _assert_same(ref, v.generate(prompts, p))
    if stops == ["\n"]:
        # the two cases the rule separates are really exercised by these prompts
        lead = ref[TEXTS.index("hello\n\n")]
        assert h.tokenizer.decode(lead.token_ids[:1]).strip() == "" and len(lead.token_ids) > 1
        assert ref[TEXTS.index("Thought: I should go.\n")].finish_reason == "stop"


def test_prefix_cache_serves_the_conversation_so_far(engines):
    v, h = engines
    tok = h.tokenizer
    long_prompt = tok(" ".join(["go to the red ball and pick up the blue key"] * 30),
                      add_special_tokens=False)["input_ids"]
    p = SamplingParams(max_new_tokens=4, greedy=True)
    first = v.generate([long_prompt], p, cache_keys=["ep-1"])[0]
    before = v.prefilled_tokens
    follow = long_prompt + first.token_ids + tok(" ok", add_special_tokens=False)["input_ids"]
    v.generate([follow], p, cache_keys=["ep-1"])
    assert v.prefilled_tokens - before < len(follow) / 2
    v.release(["ep-1"])  # nothing to drop; must accept any iterable
    v.release(k for k in ["ep-1"])


def _live_tokenizer_pools() -> int:
    """Pools of tokenizer copies alive (vLLM's renderer keeps one per engine: a queue.Queue of
    deep-copied tokenizers, reached from the functions of its ``TokenizerPool`` class)."""
    import gc
    import queue

    frozen = gc.get_freeze_count() > 0
    gc.unfreeze()  # vLLM froze the heap; frozen objects are not listed
    try:
        gc.collect()
        return sum(type(o) is queue.Queue and any(hasattr(t, "apply_chat_template") for t in list(o.queue))
                   for o in gc.get_objects())
    finally:
        if frozen:
            gc.freeze()


def test_update_weights_both_engines_agree_again(engines, hd32_path, monkeypatch):
    v, h = engines
    import agentgym.rollout.engines.vllm as vllm_module

    trims = []  # a CPU rebuild gives the old engine's freed heap back (docs/reliability.md, Soak)
    monkeypatch.setattr(vllm_module, "release_freed_heap", lambda: trims.append(1) or True)
    prompts = _prompts(h.tokenizer)
    greedy = SamplingParams(max_new_tokens=12, greedy=True)
    before = v.generate(prompts, greedy)
    pools = _live_tokenizer_pools()
    assert pools >= 1, "vLLM made no TokenizerPool: the leak check below would check nothing"
    original = [(n, p.detach().clone()) for n, p in h.model.named_parameters()]
    other, _ = load_model(hd32_path, "float32")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(torch.randn(param.shape, generator=g) * 0.5)
    world = torch.distributed.group.WORLD  # vLLM's, or a trainer's: an update must keep it
    try:
        h.update_weights(other.named_parameters())
        v.update_weights(other.named_parameters())
        assert len(trims) == (0 if v.inplace_update else 1)
        # the old engine's tokenizer pool is gone (a vLLM lru_cache kept one per re-creation;
        # docs/reliability.md, "Soak")
        assert _live_tokenizer_pools() == pools
        if world is not None:
            assert torch.distributed.group.WORLD is world
            t = torch.ones(1)
            torch.distributed.all_reduce(t)
        after_v = v.generate(prompts, greedy)
        assert [s.token_ids for s in before] != [s.token_ids for s in after_v]
        _assert_same(h.generate(prompts, greedy), after_v)
        sampled = v.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.9, seed=5))
        for prompt, s in zip(prompts, sampled):
            ref = _full_logprobs(h.model, prompt, s.token_ids, 0.7)
            assert torch.allclose(torch.tensor(s.logprobs), ref, atol=ATOL)
        with pytest.raises(KeyError):
            v.update_weights([("model.no_such.weight", torch.zeros(1))])
    finally:  # back to the original weights for the other tests
        h.update_weights(original)
        v.update_weights(original)
    _assert_same(h.generate(prompts, greedy), v.generate(prompts, greedy))


def test_default_tiny_model_is_refused_clearly(tiny_path):
    from agentgym.rollout.engines.vllm import VLLMEngine

    with pytest.raises(ValueError, match="head_dim=16"):
        VLLMEngine(tiny_path, dtype="float32")
