"""bench/roofline.py: its analytic FLOP counts against closed forms and against a second
implementation (``torch.utils.flop_counter`` on the real forward and backward of the tiny model,
eager attention so the attention matmuls are counted too; the rotary embedding's position
product is an element-wise op there, not a counted matmul), and its smoke mode's record."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import results_io  # noqa: E402
import roofline as R  # noqa: E402


@pytest.fixture(scope="module")
def eager_model(tiny_path):
    from transformers import AutoModelForCausalLM

    def make():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32, attn_implementation="eager")

    return make


def _shape(model) -> R.ModelShape:
    return R.ModelShape.from_config(model.config)


def _counted(fn) -> dict[str, int]:
    """FLOPs per aten op (global) that torch's counter records while ``fn`` runs."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return {str(op).split(".")[-1]: n for op, n in counter.get_flop_counts()["Global"].items()}


def test_matmul_forward_is_2_n_tokens(eager_model):
    """Closed form: a forward over T positions with the LM head everywhere costs 2 N T matmul
    FLOPs, N = the model's linear weights (counted from its modules: a second implementation)."""
    model = eager_model()
    m = _shape(model)
    n_linear = sum(mod.weight.numel() for mod in model.modules() if isinstance(mod, torch.nn.Linear))
    assert n_linear == m.matmul_params
    f = R.forward_flops(m, tokens=37, pairs=0, head_positions=37)
    assert f["matmul"] + f["lm_head"] == 2 * n_linear * 37 and f["attention"] == 0
    # SmolLM2-135M: 30 layers of q/k/v/o + MLP, 134.5M weights with the tied embedding once
    smol = R.ModelShape(layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152)
    assert smol.layer_matmul_params == 576 * 576 * 2 + 2 * 576 * 192 + 3 * 576 * 1536
    assert smol.matmul_params == 30 * 3_538_944 + 49152 * 576
    assert R.causal_pairs(4) == 10 and R.causal_pairs(2, cached=3) == 2 * 3 + 3


def test_forward_matches_torchs_flop_counter(eager_model):
    model = eager_model()
    m = _shape(model)
    rows, t = 2, 24
    ids = torch.randint(10, m.vocab, (rows, t))
    got = _counted(lambda: model(input_ids=ids))
    f = R.forward_flops(m, rows * t, rows * t * t, rows * t)  # eager attention computes every (q, k) pair
    assert got["mm"] + got.get("addmm", 0) == f["matmul"] + f["lm_head"]
    assert got["bmm"] == f["attention"]


def test_prefill_cost_matches_the_engines_forward(eager_model, tiny_path):
    """``HFEngine.generate(max_new_tokens=1)`` on one prompt: the layers over every token, the LM
    head on the last only; eager attention computes the full square (``executed_flops``)."""
    from transformers import AutoTokenizer

    from agentgym.rollout.engines import SamplingParams
    from agentgym.rollout.engines.hf import HFEngine

    model = eager_model()
    m = _shape(model)
    eng = HFEngine(model, AutoTokenizer.from_pretrained(tiny_path))
    prompt = list(range(10, 41))
    got = _counted(lambda: eng.generate([prompt], SamplingParams(max_new_tokens=1)))
    c = R.prefill_cost(m, [len(prompt)])
    assert got["mm"] + got.get("addmm", 0) == c.flops["matmul"] + c.flops["lm_head"]
    assert sum(got.values()) == c.detail["executed_flops"]
    assert c.flops["attention"] == m.layers * m.attn_flops_per_pair * R.causal_pairs(len(prompt))


def test_choose_cost_matches_the_engines_forwards(eager_model, tiny_path):
    """``HFEngine.choose`` on one prompt: a prefill, then one forward over the candidate tree's
    nodes (the LM head on each); the linear FLOPs agree exactly with the counter, and the
    useful attention pairs are the tree's (each node sees the prompt and its ancestors)."""
    from transformers import AutoTokenizer

    from agentgym.rollout.engines import SamplingParams
    from agentgym.rollout.engines.hf import HFEngine, candidate_tree

    model = eager_model()
    m = _shape(model)
    eng = HFEngine(model, AutoTokenizer.from_pretrained(tiny_path))
    prompt = list(range(10, 30))
    cands = [[5, 6, 7], [5, 6, 8, 9], [5, 11], [12, 13]]
    tokens, parents, _ = candidate_tree(cands)
    depths = R.tree_depths(parents)
    # the proper prefixes (5) (12) (5 6) (5 6 8): a candidate's last token is never fed
    assert tokens == [5, 12, 6, 8] and depths == [1, 1, 2, 3]
    got = _counted(lambda: eng.choose([prompt], [cands], SamplingParams()))
    c = R.choose_cost(m, cached=[0], new=[len(prompt)], depths=[depths], prefill_forwards=1, tree_forwards=1)
    linear = c.flops["prefill_matmul"] + c.flops["prefill_lm_head"] + c.flops["tree_matmul"] + c.flops["tree_lm_head"]
    assert got["mm"] + got.get("addmm", 0) == linear
    assert c.flops["tree_lm_head"] == 2 * m.head_params * 4
    # eager attention: the prefill's square and each node against the prompt and every node (masked)
    n, t = len(prompt), len(tokens)
    executed = m.layers * m.attn_flops_per_pair * (n * n + t * (n + t))
    assert got["bmm"] == executed
    useful = R.causal_pairs(n) + sum(n + d for d in depths)
    assert c.flops["prefill_attention"] + c.flops["tree_attention"] == m.layers * m.attn_flops_per_pair * useful


@pytest.mark.parametrize("train_layers", [1, None])
def test_update_forward_backward_matches_torchs_flop_counter(eager_model, train_layers):
    """The trainer's forward (``policy_forward``: the LM head on policy tokens only) and its
    backward, with the bottom layer frozen (``freeze_below``) and with everything trained: no
    weight or activation gradients below the lowest trained layer, the LM head's weight
    gradient only when the tied embedding trains."""
    from agentgym.training.batch import TrainBatch
    from agentgym.training.forward import policy_forward
    from agentgym.training.policy_trainer import freeze_below

    model = eager_model()
    model.train()
    m = _shape(model)
    if train_layers is not None:
        freeze_below(model, train_layers)
    rows, prompt, completion = 2, 12, 6
    t = prompt + completion
    ids = torch.randint(10, m.vocab, (rows, t))
    mask = torch.zeros(rows, t, dtype=torch.long)
    mask[:, prompt:] = 1
    batch = TrainBatch(ids, torch.ones_like(ids), mask, mask, mask)

    def step():
        lp, _, _, _ = policy_forward(model, batch, 1.0, False)
        (lp * mask).sum().backward()

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)  # tied weights once
    assert R.trained_params(m, train_layers) == trainable
    got = _counted(step)
    c = R.update_cost(m, [t] * rows, policy_tokens=rows * completion, micro_batches=1, train_layers=train_layers)
    full = rows * t * t / sum(R.causal_pairs(t) for _ in range(rows))  # eager: the whole square
    expected = sum(v * (full if "attention" in k else 1) for k, v in c.flops.items())
    assert sum(got.values()) == pytest.approx(expected, rel=1e-12)
    k = m.layers if train_layers is None else train_layers
    assert c.flops["backward_matmul"] == 2 * 2 * k * m.layer_matmul_params * rows * t
    assert c.flops["backward_lm_head"] == (2 if train_layers is None else 1) * c.flops["forward_lm_head"]


def test_decode_cost_and_the_bound():
    m = R.ModelShape(layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152)
    c = R.decode_cost(m, [1000] * 16)
    assert c.flops["matmul"] == 2 * 16 * 30 * m.layer_matmul_params
    assert c.flops["attention"] == 30 * 4 * 9 * 64 * 16 * 1001
    assert c.bytes["kv_read"] == 16 * 1000 * 2 * 30 * 3 * 64 * 4 and c.bytes["weights"] == m.weight_bytes
    # a compute-bound and a memory-bound stage on a machine of balance 5 FLOP/byte
    hi = R.roofline(flops=100e9, nbytes=1e9, seconds=2.0, peak_gflops=100.0, bandwidth_gbs=20.0)
    assert hi["bound"] == "compute" and hi["of_bound"] == pytest.approx(0.5) and hi["mfu"] == pytest.approx(0.5)
    lo = R.roofline(flops=10e9, nbytes=10e9, seconds=1.0, peak_gflops=100.0, bandwidth_gbs=20.0)
    assert lo["bound"] == "memory" and lo["of_bound"] == pytest.approx(0.5) and lo["gbs"] == pytest.approx(10.0)


def test_smoke_mode_runs_and_writes_its_record(tmp_path):
    env = {**os.environ, results_io.RESULTS_ENV: str(tmp_path), "OMP_WAIT_POLICY": "PASSIVE"}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "bench/roofline.py", "--smoke", "--threads", "1"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - t0
    assert out.returncode == 0, out.stderr[-3000:]
    rec = json.loads((tmp_path / "roofline-smoke.json").read_text())
    assert set(results_io.FIELDS) <= set(rec)
    assert rec["bench"] == "roofline" and rec["tag"] == "smoke" and rec["config"]["smoke"] is True
    res = rec["results"]
    assert set(res["peak"]["by_threads"]) == {"1", "2"}
    assert [r["stage"] for r in res["rows"]] == list(R.STAGES)
    for r in res["rows"]:
        assert r["flops"] > 0 and r["bytes"] > 0 and r["seconds"] > 0 and r["bound"] in ("compute", "memory")
        if r["of_bound"] < rec["config"]["profile_below"]:  # the tiny model is far below: profiled
            assert r["profile"]["top"] and r["profile"]["wall_s"] > 0
    assert {x["stage"] for x in rec["repeats"]} == set(R.STAGES)
    assert "| stage | FLOPs | bytes | seconds | GFLOP/s | MFU | GB/s | bandwidth share | bound |" in out.stdout
    print(f"smoke wall {wall:.1f} s (target < 60 s on an idle machine)")
