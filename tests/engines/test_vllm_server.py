"""``rollout.engine: vllm_server`` against a real ``vllm serve`` (vllm-cpu) on 127.0.0.1.

Runs in the vLLM env (``.venv-vllm/bin/python -m pytest tests/engines/test_vllm_server.py``);
skipped where vllm is not installed. One server for the module (it takes minutes to start on
two cores), started through ``agentgym.rollout.engines.vllm_server_launch`` with LoRA on, serving the
tiny head-dim-32 model (vLLM's CPU attention needs head_dim >= 32). The last test kills it.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the in-process reference engine
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import pytest  # noqa: E402

pytest.importorskip("vllm", reason="vLLM runs in .venv-vllm (bash scripts/setup_vllm_env.sh)")

import httpx  # noqa: E402
import torch  # noqa: E402

from agentgym.models.folders import load_model  # noqa: E402
from agentgym.rollout.engines import SamplingParams, create_engine  # noqa: E402
from agentgym.rollout.engines.vllm_server import VLLMServerEngine  # noqa: E402
from agentgym.rollout.engines.vllm_server_launch import start_vllm_server  # noqa: E402
from env_adapters.base import InfraError  # noqa: E402

pytestmark = pytest.mark.slow

ATOL = 1e-4
TEXTS = ["go to the red ball", "craft", "pick up the key and open the door now",
         "Thought: I should go.\n", "hello\n\n", "Action: "]


@pytest.fixture(scope="module")
def server(hd32_path, tmp_path_factory):
    srv = start_vllm_server(hd32_path, tmp_path_factory.mktemp("logs") / "vllm-serve.log", lora_rank=8,
                            max_model_len=1024, kv_cache_gb=0.25, timeout_s=1800)
    print(f"\nvllm serve healthy after {srv.start_seconds:.1f} s (load {os.getloadavg()})", flush=True)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def engine(server, hd32_path):
    eng = VLLMServerEngine(hd32_path, [server.url], timeout_s=600.0, retries=1)  # a loaded machine
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hf_model(hd32_path):
    return load_model(hd32_path, "float32")[0]


def _prompts(tok) -> list[list[int]]:
    return [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


def _gap_to_forward(model, prompts, samples, temperature: float) -> float:
    """Largest |engine log-prob - log_softmax(full forward / T)| over every sampled token."""
    worst = 0.0
    with torch.no_grad():
        for p, s in zip(prompts, samples):
            logits = model(torch.tensor([p + s.token_ids])).logits[0, len(p) - 1:-1].float() / temperature
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.token_ids)[:, None]).squeeze(-1)
            worst = max(worst, float((ref - torch.tensor(s.logprobs)).abs().max()))
    return worst


def test_same_tokens_as_in_process_engine_and_logprobs_of_a_full_forward(engine, hd32_path, hf_model):
    import time

    prompts = _prompts(engine.tokenizer)
    cases = [SamplingParams(max_new_tokens=12, greedy=True),
             SamplingParams(max_new_tokens=12, greedy=True, temperature=0.7),  # top_k=1: the patch
             SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=5),  # the patch
             SamplingParams(max_new_tokens=12, stop_strings=["\n"], seed=1)]
    # the server first, then the in-process engine: two vLLMs computing at once on two cores
    # starve each other
    t0 = time.perf_counter()
    remote = [engine.generate(prompts, params) for params in cases]
    t_remote = time.perf_counter() - t0
    local, _ = create_engine("vllm", hd32_path, "float32", kv_cache_gb=0.25, max_model_len=1024)
    try:
        t0 = time.perf_counter()
        ref = [local.generate(prompts, params) for params in cases]
        t_local = time.perf_counter() - t0
    finally:
        local.close()
    tokens = sum(len(s.token_ids) for batch in remote for s in batch)
    print(f"\n{tokens} tokens: vllm_server {t_remote:.2f} s, in-process vllm {t_local:.2f} s "
          f"(load {os.getloadavg()})", flush=True)
    for params, got, want in zip(cases, remote, ref):
        assert [s.token_ids for s in got] == [s.token_ids for s in want], params
        assert [s.finish_reason for s in got] == [s.finish_reason for s in want], params
        gap = _gap_to_forward(hf_model, prompts, got, params.temperature)
        assert gap < ATOL, (params, gap)


def test_lora_update_is_visible_in_the_next_rollout(engine, hd32_path, hf_model):
    from peft import LoraConfig, get_peft_model

    prompts = _prompts(engine.tokenizer)
    greedy = SamplingParams(max_new_tokens=8, greedy=True)
    before = engine.generate(prompts, greedy)
    model, _ = load_model(hd32_path, "float32")
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:  # B starts at zero: give the adapter an effect
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    name = engine.update_adapter(lambda folder: peft_model.save_pretrained(folder))
    listed = httpx.get(f"{engine.pool.servers[0].url}/v1/models").json()["data"]
    assert name in [m["id"] for m in listed]
    after = engine.generate(prompts, greedy)
    assert [s.token_ids for s in after] != [s.token_ids for s in before]
    merged = peft_model.merge_and_unload().eval()
    with torch.no_grad():  # the served tokens are the merged model's argmax, step by step
        for p, s in zip(prompts, after):
            logits = merged(torch.tensor([p + s.token_ids])).logits[0, len(p) - 1:-1]
            assert logits.argmax(-1).tolist() == s.token_ids
    assert _gap_to_forward(merged, prompts, after, 1.0) < ATOL


def test_short_training_syncs_lora_adapters_to_the_server(server, hd32_path, tmp_path):
    import pandas as pd
    from transformers import AutoModelForCausalLM

    from agentgym.config import parse_config
    from flows.train import scaling_inter_rl

    cfg = parse_config({
        "run_id": "vllm-server-flow", "seed": 0,
        "model": {"name_or_path": str(hd32_path), "dtype": "float32"},
        "envs": [{"name": "keyword", "tasks": [0, 1, 2], "kwargs": {"target": "aeiou", "mode": "char_share"}}],
        "rollout": {"engine": "vllm_server", "servers": [server.url], "adapter_dir": str(tmp_path / "adapters"),
                    "server_timeout_s": 600,
                    "tasks_per_iteration": 2, "group_size": 2, "max_new_tokens": 6},
        "trainer": {"learning_rate": 1e-2, "bf16": False, "lora": {"r": 8}},
        "schedule": {"stages": [{"horizon": 1, "iterations": 2}]},
        "store": {"root": str(tmp_path / "store")},
        "tracking": {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "vllm-server"},
    })
    result = scaling_inter_rl(cfg)
    episodes = pd.read_parquet(f"{result['store']}/episodes")
    assert len(episodes) == 2 * 2 * 2
    ckpt = result["stages"][-1]["checkpoint"].replace("file://", "")
    trained = AutoModelForCausalLM.from_pretrained(ckpt)
    start = AutoModelForCausalLM.from_pretrained(hd32_path)
    assert any(not torch.equal(a, b) for a, b in zip(trained.state_dict().values(), start.state_dict().values()))
    # the second iteration was rolled out after the first adapter sync
    assert sorted(episodes["policy_version"].unique().tolist()) == [0, 1]
    # two updates: the server holds the run's second adapter (the first was unloaded), read
    # from the adapter folder the trainer wrote
    listed = httpx.get(f"{server.url}/v1/models").json()["data"]
    adapters = {m["id"]: m["root"] for m in listed if m.get("parent")}
    ours = {n: r for n, r in adapters.items() if r.startswith(str(tmp_path))}
    assert len(ours) == 1 and next(iter(ours)).endswith("-v2"), adapters
    assert (tmp_path / "adapters" / next(iter(ours)) / "adapter_config.json").is_file()


def test_killed_server_gives_infra_errors(server, engine):  # last: it ends the module's server
    server.kill()
    assert not server.alive()
    with pytest.raises(InfraError, match="vllm_server"):
        engine.generate(_prompts(engine.tokenizer)[:2], SamplingParams(max_new_tokens=4))
