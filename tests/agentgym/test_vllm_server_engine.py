"""The vllm_server engine over HTTP, against a small real server speaking vLLM's completions
subset (tests/fake_vllm_server.py): request fields, ``token_id:N`` parsing, the stop rules, the
spread over servers, dead / slow / failing servers as InfraError, the LoRA sync calls, and the
config checks. The engine against a real ``vllm serve`` is tests/engines/test_vllm_server.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fake_vllm_server import FakeVLLM  # tests/ is on sys.path (rootdir conftest)
from transformers import AutoTokenizer

from agentgym.config import parse_config
from agentgym.rollout.engines import SamplingParams, engine_for
from agentgym.rollout.engines.vllm_rules import row_seed
from agentgym.rollout.engines.vllm_server import VLLMServerEngine, parse_choice
from agentgym.rollout.engines.vllm_server_launch import free_port
from env_adapters.base import InfraError


@pytest.fixture(scope="module")
def tok(tiny_path):
    return AutoTokenizer.from_pretrained(tiny_path)


def _echo_plus(k: int):
    """The reply: the last prompt token + 1, + 2, ... (mod 500), k of them."""
    return lambda prompt, req: [(prompt[-1] + i + 1) % 500 for i in range(k)]


@pytest.fixture
def servers(tok):
    made: list[FakeVLLM] = []

    def make(next_tokens=None, **kw) -> FakeVLLM:
        s = FakeVLLM(tok, next_tokens or _echo_plus(6), **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _engine(tiny_path, urls, **kw) -> VLLMServerEngine:
    kw.setdefault("timeout_s", 5.0)
    return VLLMServerEngine(tiny_path, urls, **kw)


def test_request_fields_and_token_id_parsing(tiny_path, servers):
    srv = servers()
    eng = _engine(tiny_path, [srv.url])
    assert eng.served_model == "base-model"  # the one model the server lists
    prompts = [[5, 6, 7], [5, 6, 7], [40]]
    out = eng.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, seed=3,
                                               stop_token_ids=[2]))
    assert [s.token_ids for s in out] == [[8, 9, 10, 11], [8, 9, 10, 11], [41, 42, 43, 44]]
    assert out[0].logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert {s.finish_reason for s in out} == {"length"}
    reqs = sorted(srv.requests, key=lambda r: r["seed"])
    assert sorted(r["prompt"] for r in reqs) == sorted(prompts)
    for r in reqs:
        assert r["model"] == "base-model" and r["logprobs"] == 0 and r["return_tokens_as_token_ids"] is True
        assert r["max_tokens"] == 4 and r["temperature"] == 0.7 and r["top_p"] == 0.9
        assert r["ignore_eos"] is True and r["include_stop_str_in_output"] is True
        assert r["stop_token_ids"] == [2] and r["n"] == 1
    # one seed per row: two copies of a prompt still sample differently
    assert sorted(r["seed"] for r in reqs) == sorted(row_seed(3, i) for i in range(3))
    assert eng.generated_tokens == 12
    # greedy: temperature 0 at T == 1; argmax at T via top_k=1 otherwise (log-probs keep T)
    srv.requests.clear()
    eng.generate([[5]], SamplingParams(max_new_tokens=2, greedy=True))
    eng.generate([[5]], SamplingParams(max_new_tokens=2, greedy=True, temperature=0.5))
    assert srv.requests[0]["temperature"] == 0.0 and "top_k" not in srv.requests[0]
    assert srv.requests[1]["temperature"] == 0.5 and srv.requests[1]["top_k"] == 1
    eng.close()


def test_parse_choice_refuses_text_tokens():
    ok = parse_choice({"finish_reason": "stop", "stop_reason": 2,
                       "logprobs": {"tokens": ["token_id:7", "token_id:2"], "token_logprobs": [-1.5, -0.25]}})
    assert (ok.token_ids, ok.logprobs, ok.finish_reason, ok.stop_reason) == ([7, 2], [-1.5, -0.25], "stop", 2)
    with pytest.raises(RuntimeError, match="token_id:N"):
        parse_choice({"logprobs": {"tokens": ["hello"], "token_logprobs": [-1.0]}})
    with pytest.raises(RuntimeError, match="log-probs"):
        parse_choice({"logprobs": None})


def test_stop_ids_and_stop_strings(tiny_path, tok, servers):
    nl = tok("\n", add_special_tokens=False)["input_ids"]
    body = tok("Action: go", add_special_tokens=False)["input_ids"]
    # replies: a stop id in the middle; then "\n" first (a stop string inside the leading
    # whitespace: the HF rule goes on), then "Action: go\n..." (the stop that counts)
    script = {1: [11, 12, 2, 13, 14], 2: nl + body + nl + [82, 270]}

    def next_tokens(prompt, req):
        return script[1] if prompt[0] == 1 else (script[2][len(prompt) - 1:])

    eng = _engine(tiny_path, [servers(next_tokens).url])
    a, b = eng.generate([[1], [2]], SamplingParams(max_new_tokens=12, stop_token_ids=[2], stop_strings=["\n"]))
    assert a.token_ids == [11, 12, 2] and a.finish_reason == "stop"
    assert b.token_ids == nl + body + nl and b.finish_reason == "stop"
    assert b.logprobs == pytest.approx([-0.1, -0.1, -0.2, -0.3, -0.4])  # two requests' pieces
    eng.close()


def test_requests_spread_over_two_servers(tiny_path, servers):
    s1, s2 = servers(delay_s=0.2), servers(delay_s=0.2)
    eng = _engine(tiny_path, [s1.url, s2.url])
    out = eng.generate([[i + 1] for i in range(8)], SamplingParams(max_new_tokens=3))
    assert [s.token_ids[0] for s in out] == [i + 2 for i in range(8)]  # rows keep their order
    assert len(s1.requests) + len(s2.requests) == 8
    assert len(s1.requests) == len(s2.requests) == 4  # least loaded: an even split
    assert eng.served_by == {s1.url: 4, s2.url: 4}
    eng.close()


def test_dead_server_skipped_and_all_dead_is_infra_error(tiny_path, servers):
    live = servers()
    dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    eng = _engine(tiny_path, [dead_url, live.url], retries=1)
    out = eng.generate([[i + 1] for i in range(4)], SamplingParams(max_new_tokens=2))
    assert len(out) == 4 and len(live.requests) == 4
    assert eng.served_by[dead_url] == 0
    assert not next(s for s in eng.pool.snapshot() if s["url"] == dead_url)["alive"]
    live.close()
    with pytest.raises(InfraError, match="vllm_server"):
        eng.generate([[1]], SamplingParams(max_new_tokens=2))
    eng.close()
    with pytest.raises(InfraError, match="no server answered"):
        _engine(tiny_path, [dead_url])


def test_timeouts_and_5xx_are_retried_then_infra_errors(tiny_path, servers):
    slow = servers(delay_s=60.0)
    eng = _engine(tiny_path, [slow.url], timeout_s=0.5, retries=1)
    t0 = time.perf_counter()
    with pytest.raises(InfraError, match="timed out"):
        eng.generate([[1]], SamplingParams(max_new_tokens=2))
    assert time.perf_counter() - t0 < 30  # two tries of 0.5 s (slack for a loaded machine), not 60 s
    assert len(slow.requests) == 2
    assert eng.pool.snapshot()[0]["alive"]  # slow is not dead: it stays in rotation
    eng.close()

    flaky = servers()
    flaky.fail_status, flaky.fail_times = 503, 1  # one failure, then fine: the retry succeeds
    eng = _engine(tiny_path, [flaky.url], retries=2)
    assert eng.generate([[1]], SamplingParams(max_new_tokens=2))[0].token_ids == [2, 3]
    flaky.fail_times = 10
    with pytest.raises(InfraError, match="HTTP 503"):
        eng.generate([[1]], SamplingParams(max_new_tokens=2))
    assert flaky.fail_times == 10 - 3  # 1 + retries tries, no more
    flaky.fail_status, flaky.fail_times = 400, 1  # a bad request is not retried
    with pytest.raises(RuntimeError, match="HTTP 400"):
        eng.generate([[1]], SamplingParams(max_new_tokens=2))
    eng.close()


def test_lora_sync_loads_lists_uses_and_unloads(tiny_path, servers, tmp_path):
    s1, s2 = servers(), servers()
    eng = _engine(tiny_path, [s1.url, s2.url], adapter_dir=tmp_path / "adapters")

    def save(folder):
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text("{}")

    first = eng.update_adapter(save)
    assert s1.adapters == s2.adapters == {first: str((tmp_path / "adapters" / first).resolve())}
    eng.generate([[1], [2]], SamplingParams(max_new_tokens=2))
    assert {r["model"] for r in s1.requests + s2.requests} == {first}
    second = eng.update_adapter(save)
    assert second != first and eng.weights_version == 2
    assert s1.adapters == s2.adapters == {second: str((tmp_path / "adapters" / second).resolve())}
    assert ("unload", {"lora_name": first}) in s1.adapter_calls
    assert not (tmp_path / "adapters" / first).exists()  # the old version's folder is gone
    # a restarted server has lost its runtime adapters: 404, the engine loads it again, retries
    s1.adapters.clear()
    s2.adapters.clear()
    out = eng.generate([[1], [2]], SamplingParams(max_new_tokens=2))
    assert [s.token_ids for s in out] == [[2, 3], [3, 4]]
    assert second in s1.adapters or second in s2.adapters
    with pytest.raises(NotImplementedError, match="trainer.lora"):
        eng.update_weights([])
    eng.close()


def _cfg(**rollout):
    return {"rollout": {"engine": "vllm_server", "servers": ["http://127.0.0.1:8000"], **rollout},
            "trainer": {"lora": {"r": 8}}}


def test_config_checks_name_the_field_and_the_fix(tiny_path):
    cfg = parse_config(_cfg())
    assert cfg.rollout.servers == ["http://127.0.0.1:8000"] and cfg.rollout.server_retries == 2
    bad = [
        ({"rollout": {"engine": "vllm_server"}, "trainer": {"lora": {"r": 8}}}, "needs rollout.servers"),
        ({"rollout": {"servers": ["http://a:1"]}}, "rollout.engine: vllm_server or servers: \\[\\]"),
        (_cfg(servers=["127.0.0.1:8000"]), "http://host:port"),
        (_cfg(constrain_actions=True), "hf engine only"),
        (_cfg(adapter_dir="s3://bucket/adapters"), "local path"),
        ({**_cfg(), "trainer": {}}, "set trainer.lora"),
        ({**_cfg(), "trainer": {"lora": {"r": 8, "modules_to_save": ["norm"]}}}, "modules_to_save: \\[\\]"),
        ({**_cfg(), "sft": {"enabled": True}}, "sft.enabled: false"),
    ]
    for raw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            parse_config(raw)
    # the servers serve the base model: a checkpoint folder cannot be served
    cfg = parse_config({**_cfg(), "model": {"name_or_path": str(tiny_path)}})
    with pytest.raises(ValueError, match="serves the base model"):
        engine_for(cfg, Path(tiny_path).parent)
