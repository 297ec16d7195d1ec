"""bench/gpu_throughput.py: its work accounting (parameters, FLOPs, bytes, roofline) against the
models themselves and closed forms, and its CPU smoke mode end to end (record fields, one row per
stage, every ratio in (0, 1.5])."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_throughput as gt  # noqa: E402
import results_io  # noqa: E402

STAGES = {"generate: prefill", "generate: decode", "generate (whole call)", "choose (turn, kept cache)",
          "update (ours, DeepSpeed)"}


@pytest.mark.parametrize("name,published,head_dim", [("0.5b", 494_032_768, 64), ("1.5b", 1_543_714_304, 128)])
def test_shapes_count_the_models_parameters(name, published, head_dim):
    """ModelShape.params (bench/roofline.py's, which gpu_throughput uses) = the parameters of the Qwen2
    model built from the config (on the meta device: no memory), and the published Qwen2.5 sizes
    (0.49B, 1.54B; embeddings tied)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**gt.SHAPES[name])
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    counted = sum(p.numel() for p in model.parameters())  # tied: the embedding once
    shape = gt.ModelShape.from_config(cfg, dtype_bytes=2)
    assert shape.params == counted == published
    assert shape.head_dim == head_dim and shape.qkv_bias and shape.dtype_bytes == 2
    # one forward pass reads the matmul weights and the (tied) embedding as LM head, once
    body = shape.layers * shape.layer_matmul_params
    assert gt.weight_bytes(shape) == 2 * (body + shape.head_params)
    assert shape.params - body - shape.head_params < 0.01 * shape.params  # biases, norms


def test_flops_and_bytes_follow_the_stated_rules():
    s = gt.ModelShape(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=100, tied=True,
                      dtype_bytes=2)
    # per layer q, o: 8x8; k, v: 8x4; gate, up, down: 8x16
    body = s.layers * s.layer_matmul_params
    assert body == 2 * (2 * 64 + 2 * 32 + 3 * 128)
    assert gt.fwd_flops(s, tokens=3, logits=1, pairs=0) == 2 * body * 3 + 2 * 800
    assert gt.fwd_flops(s, tokens=0, logits=0, pairs=5) == 4 * 8 * 2 * 5  # QK^T and AV, every layer
    # tokens x layers x (K, V) x kv heads x head dim x bytes
    assert 10 * s.kv_bytes_per_token == 10 * 2 * 2 * 1 * 4 * 2
    for new in range(5):
        for cached in range(4):
            brute = sum(cached + i + 1 for i in range(new))  # each token sees the cache, those before, itself
            assert gt.causal_pairs(new, cached) == brute


def test_roofline_sums_each_pass_bound():
    peak, bw = 100.0, 10.0
    compute, memory = gt.Pass(flops=1000.0, bytes=10.0), gt.Pass(flops=10.0, bytes=100.0)
    assert compute.roof_s(peak, bw) == (10.0, "compute") and memory.roof_s(peak, bw) == (10.0, "memory")
    total, bound = gt.roofline([compute, memory, memory], peak, bw)
    assert total == 30.0 and bound == "memory"


def test_the_budget_caps_repeats_and_keeps_at_least_one(monkeypatch):
    b = gt.Budget(100.0)
    monkeypatch.setattr(gt, "T_START", gt.time.monotonic() - 39.0)  # 61 s left
    assert b.reps(one_s=1.0, want=5, share=0.5) == 5
    assert b.reps(one_s=10.0, want=5, share=0.5) == 3
    assert b.reps(one_s=100.0, want=5, share=0.5) == 1
    b.reserve = 100.0
    assert b.allowance(1.0) == 0.0 and b.reps(one_s=0.1, want=5, share=1.0) == 1
    monkeypatch.setattr(gt, "T_START", gt.time.monotonic() - 500.0)  # over budget
    assert b.left() < 0 and b.reps(one_s=0.1, want=5, share=1.0) == 1


def test_candidates_look_like_babyai_actions():
    import torch

    words = {w: i for i, w in enumerate(["turn", "left", "right", "move", "forward", "toggle", "go", "to", "the",
                                         "pick", "up", *gt.COLORS, *gt.OBJECTS], start=10)}
    cands = gt.babyai_candidates(torch.Generator().manual_seed(0), words, 16, eot=2)
    assert len(cands) == len({tuple(c) for c in cands}) == 16
    assert all(c[-1] == 2 and 2 <= len(c) <= 6 for c in cands)
    assert sum(c[:3] == [words["go"], words["to"], words["the"]] for c in cands) >= 5  # shared prefixes


def test_git_commit_fills_in_only_where_git_cannot_say(monkeypatch):
    monkeypatch.setattr(results_io, "git_state", lambda root=None: {"commit": None, "dirty": None, "changed": []})
    gt._git_fallback("a" * 40)
    state = results_io.git_state()
    assert state["commit"] == "a" * 40 and state["dirty"] is True and state["changed"]
    monkeypatch.setattr(results_io, "git_state", lambda root=None: {"commit": "b" * 40, "dirty": False, "changed": []})
    gt._git_fallback("a" * 40)
    assert results_io.git_state() == {"commit": "b" * 40, "dirty": False, "changed": []}


@pytest.mark.slow
def test_smoke_mode_runs_every_stage_and_writes_its_record(tmp_path):
    """The CPU smoke end to end in a child process (as a user runs it): exit 0, the Markdown table,
    the record at <results>/gpu_throughput-smoke.json with results_io's fields, one row per stage
    with consistent numbers and ratios in (0, 1.5]. --trl is asked: TRL is not in the main venv,
    so the record says why it was skipped (or, where TRL is importable, has its row)."""
    env = {**os.environ, results_io.RESULTS_ENV: str(tmp_path), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "bench/gpu_throughput.py", "--smoke", "--trl"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "| model | stage | tokens | median s | tok/s | TFLOP/s | MFU | GB/s | BW share | bound | roofline share |" \
        in out.stdout
    rec = json.loads((tmp_path / "gpu_throughput-smoke.json").read_text())

    assert set(results_io.FIELDS) <= set(rec)
    assert rec["bench"] == "gpu_throughput" and rec["tag"] == "smoke" and rec["config"]["smoke"] is True
    assert len(rec["git"]["commit"]) == 40 and rec["machine"]["cores"] >= 1 and len(rec["load"]["end"]) == 3
    res = rec["results"]
    assert res["dtype"] == "float32" and res["gpu"] is None
    assert all(s["why"] for s in res["skipped"])  # only TRL may be skipped here, and it says why
    roof = res["roofline"]
    assert roof["matmul_flops"] > 0 and roof["copy_bytes_per_s"] > 0

    rows = {r["stage"]: r for r in res["rows"]}
    trl = "update (TRL GRPOTrainer)"
    assert STAGES <= set(rows) <= STAGES | {trl}
    if trl not in rows:
        assert "cannot be imported" in res["trl"] or any(s.get("stage") == "update (TRL)" for s in res["skipped"])
    for r in rows.values():
        assert r["model"] == "tiny" and r["tokens"] > 0 and r["s"] > 0 and r["reps"] >= 1
        assert math.isclose(r["tok_s"], r["tokens"] / r["s"], rel_tol=1e-9)
        assert r["flops"] > 0 and r["bytes"] > 0 and r["bound"] in ("compute", "memory")
        assert math.isclose(r["mfu"], r["flops"] / r["s"] / roof["matmul_flops"], rel_tol=1e-9)
        for ratio in ("mfu", "bw_share", "roofline_share"):
            assert 0 < r[ratio] <= 1.5, (r["stage"], ratio, r[ratio])
        # the roofline share is the larger of the two shares for a one-pass stage, never below either
        assert r["roofline_share"] >= min(r["mfu"], r["bw_share"]) * (1 - 1e-9)
    cfg = rec["config"]
    assert rows["generate (whole call)"]["tokens"] == cfg["gen_rows"] * cfg["gen_new"]
    assert rows["generate: prefill"]["tokens"] == cfg["gen_rows"] * cfg["gen_prompt"]
    assert rows["update (ours, DeepSpeed)"]["tokens"] == cfg["rows"] * cfg["completion"]
    choose = rows["choose (turn, kept cache)"]
    # the timed turn prefilled only the observation and the candidate trees: the kept cache served the rest
    assert choose["prefilled"] == choose["tokens"] == cfg["choose_rows"] * cfg["choose_obs"] + choose["tree_nodes"]

    stages = {(r["stage"], r["rep"]) for r in rec["repeats"]}
    for stage in ("matmul", "copy"):
        assert {(stage, i) for i in range(cfg["roofline_reps"])} <= stages
    for stage in ("prefill", "generate", "choose", "update"):
        assert (stage, 0) in stages
    assert not subprocess.run(["git", "check-ignore", "-q", "bench/results/gpu_throughput-smoke.json"],
                              cwd=ROOT).returncode  # smoke records stay out of git
