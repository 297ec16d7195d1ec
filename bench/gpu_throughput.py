"""GPU throughput: the hf engine's rollout and the DeepSpeed trainer's update against the GPU's own roofline.

    python bench/gpu_throughput.py                              # one GPU, bf16, both models, sized for <= 8 min
    python bench/gpu_throughput.py --trl                        # + TRL GRPOTrainer's update step
    nice -n 19 .venv/bin/python bench/gpu_throughput.py --smoke  # CPU, tiny model, fp32, < 60 s (the test)

Issue 44 item 5. On one CUDA GPU, for randomly initialised models of the published Qwen2.5-0.5B
and Qwen2.5-1.5B shapes (``Qwen2Config`` built here: nothing is downloaded), in bf16:

* **roofline** of this GPU, measured in the same run: matmul TFLOP/s (an 8192^3 bf16 product,
  ``--matmul-n``, timed with CUDA events, best of ``--roofline-reps`` means of 10) and memory
  bandwidth (a 1 GiB device-to-device ``copy_``, bytes read + written, same timing);
* **rollout** with this project's engine (``agentgym/rollout/engines/hf.py``, ``HFEngine``):
  ``generate`` over a batch of random prompts (``--gen-rows`` x ``--gen-prompt`` tokens,
  ``--gen-new`` new tokens each, sampled at temperature 1, no stop token, so every row decodes
  all of them); the same call with 1 new token gives the prefill alone, and decode = generate -
  prefill (medians). ``choose`` as a rollout turn calls it (the quickstart's path): each row's
  conversation (``--choose-context`` tokens) is already in the engine's kept KV cache (an
  untimed priming call), the timed call adds an observation of ``--choose-obs`` tokens and
  scores ``--choose-cands`` candidate actions per row shaped like BabyAI's ("go to the red
  ball", "pick up the blue key", "turn left", ... + end of turn, one token a word: shared
  prefixes, scored as one token tree per row), then samples one;
* **update** with this project's trainer (``agentgym/training/policy_trainer.py``,
  ``PolicyTrainer.train_on_batch``) driven as ``bench/update_throughput.py`` drives it: one GRPO
  step (ppo_epochs 1, one mini-batch, micro-batches of ``--micro`` rows accumulated) on a fixed
  batch of ``--rows`` x (``--prompt`` + ``--completion``) random tokens, loss mask on the
  completion, advantages +-1, old log-probs = the policy's own (``PolicyTrainer.compute``, so the
  ratio is 1), AdamW lr 1e-6, clip 0.2/0.2, no KL, token-mean, grad clip 1.0, ZeRO ``--zero``,
  DeepSpeed bf16 (fp32 master weights), gradient checkpointing off. Throughput = trained
  (completion) tokens / step seconds, as update_throughput reports it; a warm-up step first;
* **TRL** (``--trl``): ``trl.GRPOTrainer``'s update step on the same batch, the same GPU and the
  same settings, driven the way ``bench/update_throughput.py`` drives it (``trl_child``: a
  subclass whose ``_prepare_inputs`` returns the given micro-batch, then ``training_step`` per
  micro-batch, ``clip_grad_norm_``, ``optimizer.step``). ``trl_child`` itself is not called: it
  is wired to the CPU (``use_cpu=True``, fp32, its own venv), so this script runs the same steps
  in a child process of its own (same Python; its own CUDA context, no DeepSpeed process group)
  with ``bf16=True`` (autocast over fp32 weights, TRL's mixed precision) and gradient
  checkpointing off (checked on the model), and checks the TRL version against
  ``update_throughput.TRL_PINS``. Where TRL cannot be imported (its wheels were not carried to
  the device), the script says so, records why, and skips it.

Every stage's work is derived from the model shape (``ModelShape`` and ``forward_flops`` of
``bench/roofline.py``, the one FLOP/byte model of the bench scripts), and stated here so a reader
can redo it:

* FLOPs (model FLOPs, useful tokens only, pads not counted): 2 x the matmul weights per token fed
  (q, k, v, o, gate, up, down; biases and norms not counted), the LM head (2 x hidden x vocab)
  only where the code computes logits (prefill and decode: the last position; ``choose``'s
  candidate tree: every node; the trainer: the completion tokens), **plus attention**: 4 x hidden
  per (query, key) pair per layer (QK^T and AV), counting only the keys a token attends to
  (causal prefix, its candidate-tree ancestors). The update is 3 x its forward (backward = 2 x).
* Bytes (a lower bound: activations and logits not counted): each forward pass reads every
  matmul weight once (the tied embedding once, as the LM head; norms and biases not counted)
  and reads the KV cache it attends to from memory (decode: the whole context of every row at
  every step; prefill and tree scoring: the cached prefix) and writes the new keys/values. The
  update reads the weights 3 x per micro-batch (forward, backward, gradient write) and AdamW
  moves 30 bytes per parameter per step (bf16: read fp32 master, grad, m, v; write master, m, v;
  write the bf16 copy; fp32: 28).
* Each pass's roofline time is max(FLOPs / peak FLOP/s, bytes / peak bandwidth); a stage's is
  the sum over its passes (prefill, every decode step, every scoring chunk, every micro-batch).
  Columns: MFU = achieved FLOP/s / measured matmul peak; BW share = achieved bytes/s / measured
  copy bandwidth; roofline share = roofline time / measured time (1.0 = at the bound); bound =
  which term dominates the stage's roofline.

Time guard (``--budget-s``, default 420 s on a GPU so that the run, Python's start included,
ends inside 8 minutes on one H100): every stage runs one warm-up and then as many timed
repeats (up to ``--reps``, at least 1) as fit its share of what is left of the budget; a model
whose estimated cost (the previous model's, scaled by the parameter ratio) does not fit what is
left is skipped and recorded as skipped. Progress goes to stderr with the elapsed time. The
record (``bench/results/gpu_throughput-<tag>.json``, ``bench/results_io.py``; the tag is ``--tag``
or ``<card>-<UTC time>``; ``AGENTGYM_BENCH_RESULTS`` puts it elsewhere, e.g. the device tool's
``$OUT``) is rewritten after every model, so a run cut short still leaves what it measured.
``--git-commit`` names the commit where the machine has no git to ask.

``--smoke``: the CPU, fp32, one torch thread, a tiny model of the same architecture (the
project's tiny test tokenizer, 2 layers, hidden 64), a few tokens per stage, budget 45 s; tag
``smoke`` (git-ignored). It checks the mechanics (tests/bench/test_gpu_throughput.py), not speed.

Needs: torch (with CUDA, outside ``--smoke``), transformers, deepspeed, pydantic (the
project's config); TRL 1.16 (+ datasets, dill, multiprocess) for ``--trl``. The device's image
lacks deepspeed and pydantic: ``bench/gpu_wheels.sh`` gathers the wheels to carry
(bench/README.md, section 12, has the device command).
"""

from __future__ import annotations

import time

T_START = time.monotonic()  # the budget counts from here: imports included

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(HERE), str(ROOT)):  # results_io, update_throughput; agentgym where it is not installed (the device)
    if _p not in sys.path:
        sys.path.insert(0, _p)

import results_io  # noqa: E402
from roofline import ModelShape, causal_pairs, forward_flops, tree_depths  # noqa: E402  the FLOP/byte model

BENCH = "gpu_throughput"
#: the published shapes (Qwen/Qwen2.5-0.5B and -1.5B config.json: both tie the embeddings)
SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    # --smoke: the same architecture, tiny (vocabulary = the tiny test tokenizer's)
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=None, tie_word_embeddings=True),
}
#: seconds kept, per model still to run, for its set-up (GPU: building, saving and loading 1.5B and
#: DeepSpeed's start are some tens of seconds)
RESERVE_S = 60.0
#: AdamW's memory traffic per parameter per optimizer step (see the docstring)
ADAM_BYTES = {"bfloat16": 30, "float32": 28}
#: BabyAI-like action vocabulary for ``choose``'s candidates
COLORS = ["red", "green", "blue", "purple", "yellow", "grey"]
OBJECTS = ["ball", "box", "key", "door"]


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T_START:6.1f} s] {msg}", file=sys.stderr, flush=True)


# -- arguments -------------------------------------------------------------------------------------

def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, fp32, a few tokens, < 60 s (the test)")
    ap.add_argument("--models", default="0.5b,1.5b", help="comma-separated: 0.5b, 1.5b (--smoke: tiny)")
    ap.add_argument("--trl", action="store_true", help="also TRL GRPOTrainer's update step (skipped if TRL "
                    "cannot be imported)")
    ap.add_argument("--budget-s", type=float, default=None, help="wall-clock budget of the whole run, imports "
                    "included (default 420 on a GPU, 45 with --smoke)")
    ap.add_argument("--reps", type=int, default=None, help="timed repeats per stage at most (default 5; "
                    "--smoke 2); fewer when the budget is short, never fewer than 1")
    ap.add_argument("--gen-rows", type=int, default=64)
    ap.add_argument("--gen-prompt", type=int, default=512)
    ap.add_argument("--gen-new", type=int, default=128)
    ap.add_argument("--choose-rows", type=int, default=64)
    ap.add_argument("--choose-context", type=int, default=512)
    ap.add_argument("--choose-obs", type=int, default=64)
    ap.add_argument("--choose-cands", type=int, default=16)
    ap.add_argument("--rows", type=int, default=32, help="update: rows of the batch")
    ap.add_argument("--prompt", type=int, default=256, help="update: prompt tokens per row (loss mask 0)")
    ap.add_argument("--completion", type=int, default=256, help="update: completion tokens per row (trained)")
    ap.add_argument("--micro", type=int, default=8, help="update: rows per micro-batch")
    ap.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                    help="DeepSpeed ZeRO stage of ours (0: what trainer.zero_stage auto runs for one rank)")
    ap.add_argument("--matmul-n", type=int, default=8192)
    ap.add_argument("--copy-mib", type=int, default=1024)
    ap.add_argument("--roofline-reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (--smoke; 1 on this shared "
                    "2-core machine, see bench/README.md)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--git-commit", default="", help="the commit the working tree was sent from, for a machine "
                    "without git (the device tool copies the tree, not .git): recorded as the record's commit, "
                    "with dirty true (what was sent cannot be checked there); ignored where git answers")
    ap.add_argument("--trl-child", metavar="BATCH_FILE", help=argparse.SUPPRESS)
    ap.add_argument("--trl-model", help=argparse.SUPPRESS)
    ap.add_argument("--trl-device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--trl-allowance", type=float, default=60.0, help=argparse.SUPPRESS)
    results_io.add_tag_argument(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.models = "tiny"
        args.gen_rows, args.gen_prompt, args.gen_new = 4, 32, 8
        args.choose_rows, args.choose_context, args.choose_obs, args.choose_cands = 4, 32, 8, 6
        args.rows, args.prompt, args.completion, args.micro = 4, 16, 16, 2
        args.matmul_n, args.copy_mib, args.roofline_reps = 512, 64, 2
        args.budget_s = 45.0 if args.budget_s is None else args.budget_s
        args.reps = 2 if args.reps is None else args.reps
    args.budget_s = 420.0 if args.budget_s is None else args.budget_s
    args.reps = 5 if args.reps is None else args.reps
    if args.rows % args.micro:
        ap.error("--rows must be a multiple of --micro (TRL's gradient accumulation)")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if m not in SHAPES or (m == "tiny") != args.smoke]
    if bad or not models:
        ap.error(f"--models: {bad or models}; choose from 0.5b, 1.5b (tiny is --smoke's)")
    args.models = ",".join(models)
    return args


# -- the budget ------------------------------------------------------------------------------------

class Budget:
    """What is left of ``total`` seconds since the script started, and how many repeats fit."""

    def __init__(self, total: float):
        self.total = total
        self.reserve = 0.0  # seconds kept for what is not a stage's repeats (the next models' set-up)

    def elapsed(self) -> float:
        return time.monotonic() - T_START

    def left(self) -> float:
        return self.total - self.elapsed()

    def allowance(self, share: float) -> float:
        """``share`` of what is left, less the reserve."""
        return max(0.0, self.left() - self.reserve) * share

    def reps(self, one_s: float, want: int, share: float) -> int:
        """Timed repeats of ``one_s`` seconds each in ``share`` of what is left: 1..want."""
        return max(1, min(want, int(self.allowance(share) // max(one_s, 1e-6))))


# -- the model's work ------------------------------------------------------------------------------

def fwd_flops(shape: ModelShape, tokens: int, logits: int, pairs: int) -> float:
    """One forward's FLOPs (``roofline.forward_flops``): ``tokens`` fed, ``logits`` positions through
    the LM head, ``pairs`` (query, key) pairs per layer."""
    return sum(forward_flops(shape, tokens, pairs, logits).values())


def weight_bytes(shape: ModelShape) -> int:
    """What one forward pass reads of the weights here: the matmul weights, the tied matrix once as
    the LM head (norms and biases not counted, unlike ``ModelShape.weight_bytes``)."""
    return shape.matmul_params * shape.dtype_bytes


@dataclass
class Pass:
    """One forward (or forward + backward) pass: its FLOPs and bytes."""

    flops: float
    bytes: float

    def roof_s(self, peak_flops: float, peak_bw: float) -> tuple[float, str]:
        tc, tm = self.flops / peak_flops, self.bytes / peak_bw
        return (tc, "compute") if tc >= tm else (tm, "memory")


def roofline(passes: list[Pass], peak_flops: float, peak_bw: float) -> tuple[float, str]:
    """Sum of the passes' roofline times, and the bound that dominates it."""
    total, by = 0.0, {"compute": 0.0, "memory": 0.0}
    for p in passes:
        t, b = p.roof_s(peak_flops, peak_bw)
        total += t
        by[b] += t
    return total, max(by, key=lambda k: by[k])


# -- timing ----------------------------------------------------------------------------------------

def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: Any) -> tuple[float, Any]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def kernel_s(fn: Callable[[], Any], device: Any, inner: int) -> float:
    """Mean seconds of ``fn`` over ``inner`` back-to-back calls (CUDA events on a GPU)."""
    import torch

    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0 / inner
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def measure_roofline(args, device, dtype, repeats: list[dict]) -> dict[str, Any]:
    """Peak matmul FLOP/s and copy bandwidth of this device, best of ``--roofline-reps``."""
    import torch

    n = args.matmul_n
    g = torch.Generator(device=device).manual_seed(1)
    a = torch.randn((n, n), device=device, dtype=dtype, generator=g)
    b = torch.randn((n, n), device=device, dtype=dtype, generator=g)
    out = torch.empty((n, n), device=device, dtype=dtype)
    inner = 10 if device.type == "cuda" else 3
    mm = lambda: torch.matmul(a, b, out=out)  # noqa: E731
    kernel_s(mm, device, 3)  # warm-up (cuBLAS heuristics, clocks)
    flops = []
    for r in range(args.roofline_reps):
        s = kernel_s(mm, device, inner)
        flops.append(2 * n**3 / s)
        repeats.append({"model": None, "stage": "matmul", "rep": r, "s": s, "n": n, "dtype": str(dtype),
                        "tflops": 2 * n**3 / s / 1e12})
    del a, b, out
    numel = args.copy_mib * 2**20 // 4
    src = torch.ones(numel, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    cp = lambda: dst.copy_(src)  # noqa: E731
    kernel_s(cp, device, 3)
    bws = []
    for r in range(args.roofline_reps):
        s = kernel_s(cp, device, inner)
        bws.append(2 * numel * 4 / s)  # read + written
        repeats.append({"model": None, "stage": "copy", "rep": r, "s": s, "bytes": 2 * numel * 4,
                        "gbps": 2 * numel * 4 / s / 1e9})
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"matmul_flops": max(flops), "copy_bytes_per_s": max(bws), "matmul_n": n, "matmul_dtype": str(dtype),
            "copy_bytes": 2 * numel * 4, "rule": "best of the repeats; each a mean of "
            f"{inner} back-to-back calls after 3 warm-ups; copy counts bytes read + written"}


# -- building the model ----------------------------------------------------------------------------

def tokenizer_folder() -> Path:
    """The project's tiny test model folder: its tokenizer (ChatML, <|endoftext|> pad) serves every model
    here (the engine and trainer read only its pad id; ids are drawn at random)."""
    from agentgym.models.folders import tiny_model_path

    return tiny_model_path()


def build_model(name: str, tok: Any, device: Any, dtype: Any, seed: int, folder: Path) -> tuple[Any, ModelShape]:
    """A randomly initialised Qwen2 model of shape ``name`` on ``device`` in ``dtype``, also saved
    (with the tokenizer) to ``folder`` for the trainer, which loads a folder."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(SHAPES[name])
    if shape["vocab_size"] is None:
        shape["vocab_size"] = len(tok)
    cfg = Qwen2Config(**shape, max_position_embeddings=32768, rms_norm_eps=1e-6, use_sliding_window=False,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    model.to(dtype).eval()
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return model, ModelShape.from_config(cfg, dtype_bytes=torch.finfo(dtype).bits // 8)


def random_ids(g: Any, rows: int, length: int, vocab: int) -> list[list[int]]:
    import torch

    return torch.randint(10, vocab, (rows, length), generator=g).tolist()


def babyai_candidates(g: Any, words: dict[str, int], k: int, eot: int) -> list[list[int]]:
    """``k`` candidate actions as token ids: the three moves, toggle, then go to / pick up a random
    colour and object (one token per word, end of turn last), as BabyAI's valid actions look."""
    import torch

    cands = [["turn", "left"], ["turn", "right"], ["move", "forward"], ["toggle"]]
    pairs = [(c, o) for c in COLORS for o in OBJECTS]
    order = torch.randperm(len(pairs), generator=g).tolist()
    for i in order:
        if len(cands) >= 2 * k:
            break
        c, o = pairs[i]
        cands += [["go", "to", "the", c, o], ["pick", "up", "the", c, o]]
    return [[words[w] for w in c] + [eot] for c in cands[:k]]


# -- the stages ------------------------------------------------------------------------------------

def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def stage_row(model: str, stage: str, tokens: int, times: list[float], passes: list[Pass], roof: dict,
              **extra: Any) -> dict[str, Any]:
    """A table row: median seconds, tokens/s and the roofline columns."""
    s = _median(times)
    flops = sum(p.flops for p in passes)
    nbytes = sum(p.bytes for p in passes)
    roof_s, bound = roofline(passes, roof["matmul_flops"], roof["copy_bytes_per_s"])
    return {"model": model, "stage": stage, "tokens": tokens, "s": s, "tok_s": tokens / s, "flops": flops,
            "bytes": nbytes, "tflops": flops / s / 1e12, "mfu": flops / s / roof["matmul_flops"],
            "gbps": nbytes / s / 1e9, "bw_share": nbytes / s / roof["copy_bytes_per_s"], "roofline_s": roof_s,
            "bound": bound, "roofline_share": roof_s / s, "reps": len(times), **extra}


def run_rollout(name: str, model: Any, tok: Any, shape: ModelShape, args, device, roof: dict, budget: Budget,
                share: float, repeats: list[dict]) -> list[dict[str, Any]]:
    """generate (prefill, decode, whole) and choose over a kept cache; rows of the table."""
    import torch

    from agentgym.rollout.engines.base import SamplingParams
    from agentgym.rollout.engines.hf import HFEngine, candidate_tree, length_groups

    engine = HFEngine(model, tok)
    g = torch.Generator().manual_seed(args.seed + 1)
    rows_out: list[dict[str, Any]] = []
    w = weight_bytes(shape)

    # generate: the prefill alone (1 new token), then the whole call
    B, P, D = args.gen_rows, args.gen_prompt, args.gen_new
    prompts = random_ids(g, B, P, shape.vocab)

    def gen(new: int, seed: int) -> float:
        params = SamplingParams(max_new_tokens=new, temperature=1.0, top_p=1.0, stop_token_ids=[], seed=seed)
        s, out = timed(lambda: engine.generate(prompts, params), device)
        made = sum(len(x.token_ids) for x in out)
        if made != B * new:
            raise RuntimeError(f"generate made {made} tokens, expected {B * new} (no stop token is set)")
        return s

    t_warm = gen(D, 0)
    n = budget.reps(t_warm * 1.1, args.reps, share * 0.6)
    t_pre, t_gen = [], []
    for r in range(n):
        t_pre.append(gen(1, r + 1))
        t_gen.append(gen(D, r + 1))
        repeats += [{"model": name, "stage": "prefill", "rep": r, "s": t_pre[-1]},
                    {"model": name, "stage": "generate", "rep": r, "s": t_gen[-1]}]
    log(f"{name}: generate {B} x ({P} + {D}) tokens: {_median(t_gen):.3f} s, prefill {_median(t_pre):.3f} s ({n} reps)")
    pre = Pass(fwd_flops(shape, B * P, B, B * causal_pairs(P, 0)), w + B * P * shape.kv_bytes_per_token)
    # decode step k = 1..D-1 feeds sampled token k: it attends the P + k - 1 tokens before it and
    # itself, reads their keys/values from the cache and writes its own
    steps = [Pass(fwd_flops(shape, B, B, B * (P + k)), w + B * (P + k) * shape.kv_bytes_per_token)
             for k in range(1, D)]
    rows_out.append(stage_row(name, "generate: prefill", B * P, t_pre, [pre], roof))
    t_dec = [max(a - b, 1e-9) for a, b in zip(t_gen, t_pre)]
    rows_out.append(stage_row(name, "generate: decode", B * (D - 1), t_dec, steps, roof,
                              note="generate - prefill, per repeat"))
    rows_out.append(stage_row(name, "generate (whole call)", B * D, t_gen, [pre, *steps], roof,
                              note="tokens = generated tokens"))

    # choose: a turn over a kept cache
    B, P, E, K = args.choose_rows, args.choose_context, args.choose_obs, args.choose_cands
    vocab_words = ["turn", "left", "right", "move", "forward", "toggle", "go", "to", "the", "pick", "up",
                   *COLORS, *OBJECTS]
    word_ids = torch.randperm(shape.vocab - 10, generator=g)[: len(vocab_words)] + 10
    words = dict(zip(vocab_words, word_ids.tolist()))
    eot = tok.eos_token_id
    base = random_ids(g, B, P, shape.vocab)
    obs = random_ids(g, B, E, shape.vocab)
    cands = [babyai_candidates(g, words, K, eot) for _ in range(B)]
    turn = [b + o for b, o in zip(base, obs)]
    keys = [f"row{i}" for i in range(B)]
    trees = [candidate_tree(c) for c in cands]
    sizes = [len(t[0]) for t in trees]

    def choose_turn(seed: int) -> tuple[float, int]:
        params = SamplingParams(temperature=1.0, seed=seed)
        engine.release(keys)
        engine.choose(base, cands, params, cache_keys=keys)  # the conversation so far: untimed
        before = engine.prefilled_tokens
        s, out = timed(lambda: engine.choose(turn, cands, params, cache_keys=keys), device)
        assert len(out) == B
        return s, engine.prefilled_tokens - before

    t_warm, _ = choose_turn(0)
    n = budget.reps(t_warm * 2.2, args.reps, share * 0.3)  # each repeat primes too
    t_ch, prefilled = [], 0
    for r in range(n):
        s, prefilled = choose_turn(r + 1)
        t_ch.append(s)
        repeats.append({"model": name, "stage": "choose", "rep": r, "s": s, "prefilled": prefilled})
    expected = B * E + sum(sizes)
    if prefilled != expected:
        log(f"warning: choose prefilled {prefilled} tokens, expected {expected} (observations + trees): "
            "the kept cache was not used as planned")
    ctx = P + E
    passes = [Pass(fwd_flops(shape, B * E, B, B * causal_pairs(E, P)), w + B * (P + E) * shape.kv_bytes_per_token)]
    # the scoring forwards, grouped and chunked as HFEngine._candidate_logprobs does
    for group in length_groups(sizes, engine.max_padding):
        t_max = sizes[group[0]]
        if t_max == 0:
            continue
        step = max(1, engine.max_scoring_logits // (t_max * shape.vocab))
        for a in range(0, len(group), step):
            chunk = group[a:a + step]
            nodes = sum(sizes[i] for i in chunk)
            depth_sum = sum(sum(tree_depths(trees[i][1])) for i in chunk)
            passes.append(Pass(fwd_flops(shape, nodes, nodes, nodes * ctx + depth_sum),
                               w + (len(chunk) * ctx + nodes) * shape.kv_bytes_per_token))
    log(f"{name}: choose {B} rows x {K} candidates ({sum(sizes)} tree nodes) after {P} + {E} tokens: "
        f"{_median(t_ch):.3f} s ({n} reps)")
    rows_out.append(stage_row(name, "choose (turn, kept cache)", expected, t_ch, passes, roof,
                              turns_per_s=B / _median(t_ch), candidates=K, tree_nodes=sum(sizes),
                              prefilled=prefilled, note="tokens = observation + candidate-tree tokens fed"))
    engine.close()
    return rows_out


def update_batch(shape: ModelShape, args, pad_id: int) -> Any:
    import torch

    from agentgym.training.batch import TrainBatch

    g = torch.Generator().manual_seed(args.seed + 2)
    ids = torch.randint(10, shape.vocab, (args.rows, args.prompt + args.completion), generator=g).tolist()
    rows = []
    for i, x in enumerate(ids):
        mask = [0] * args.prompt + [1] * args.completion
        adv = 1.0 if i % 2 else -1.0
        rows.append({"input_ids": x, "loss_mask": mask, "old_logprobs": [0.0] * len(x),
                     "advantages": [adv * m for m in mask]})
    return TrainBatch.from_rows(rows, pad_id)


def update_passes(shape: ModelShape, args, adam_bytes: int) -> list[Pass]:
    T = args.prompt + args.completion
    passes = []
    for _ in range(args.rows // args.micro):
        m = args.micro
        passes.append(Pass(3 * fwd_flops(shape, m * T, m * args.completion, m * causal_pairs(T, 0)),
                           3 * weight_bytes(shape)))
    passes.append(Pass(0.0, shape.params * adam_bytes))
    return passes


def run_update(name: str, folder: Path, tok: Any, shape: ModelShape, args, device, roof: dict, budget: Budget,
               share: float, repeats: list[dict], bf16: bool) -> tuple[dict[str, Any], Any]:
    """One GRPO step of PolicyTrainer (as bench/update_throughput.py's ``ours``); the row and the batch."""
    import torch

    from agentgym.config import AlgorithmConfig, TrainerConfig
    from agentgym.training.policy_trainer import PolicyTrainer

    cfg = TrainerConfig(learning_rate=1e-6, zero_stage=args.zero, bf16=bf16, micro_batch_size=args.micro,
                        grad_clip=1.0, gradient_checkpointing=False)
    algo = AlgorithmConfig(estimator="grpo", ppo_epochs=1, mini_batches=1, clip_low=0.2, clip_high=0.2,
                           kl_coef=0.0, entropy_coef=0.0, loss_agg="token-mean")
    t_init, tr = timed(lambda: PolicyTrainer(folder, tok, cfg, algo, temperature=1.0, seed=0), device)
    log(f"{name}: PolicyTrainer ready in {t_init:.1f} s (DeepSpeed ZeRO-{args.zero}, bf16={bf16})")
    batch = update_batch(shape, args, tok.pad_token_id)
    batch = replace(batch, old_logprobs=tr.compute(batch, ["logprobs"])["logprobs"])  # ratio 1
    t_warm, _ = timed(lambda: tr.train_on_batch(batch, seed=0), device)
    n = budget.reps(t_warm, args.reps, share)
    times = []
    for r in range(n):
        s, m = timed(lambda: tr.train_on_batch(batch, seed=r + 1), device)
        times.append(s)
        repeats.append({"model": name, "stage": "update", "rep": r, "s": s, "loss": m.get("loss"),
                        "optimizer_steps": m.get("optimizer_steps")})
    trained = args.rows * args.completion
    log(f"{name}: update {args.rows} x ({args.prompt} + {args.completion}): {_median(times):.3f} s ({n} reps)")
    row = stage_row(name, "update (ours, DeepSpeed)", trained, times,
                    update_passes(shape, args, ADAM_BYTES["bfloat16" if bf16 else "float32"]), roof,
                    init_s=t_init, warmup_s=t_warm, note="tokens = trained (completion) tokens")
    tr.close()
    engine = tr.engine
    del tr
    try:
        engine.destroy()
    except Exception:  # noqa: BLE001 - older DeepSpeed: nothing to release
        pass
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, batch


def trl_available() -> tuple[bool, str]:
    try:
        import trl  # noqa: F401
        import datasets  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: skip TRL
        return False, (f"TRL cannot be imported here ({type(e).__name__}: {e}); carry its wheels "
                       "(bench/gpu_wheels.sh --trl)")
    return True, f"trl {trl.__version__}"


#: what DeepSpeed's one-process group leaves in the environment: a TRL child must not inherit it
#: (accelerate would take it for a launched distributed run)
_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_trl(name: str, folder: Path, batch: Any, shape: ModelShape, args, device, roof: dict, budget: Budget,
            share: float, repeats: list[dict], bf16: bool) -> dict[str, Any]:
    """TRL GRPOTrainer's update step on the same batch and model, in a child process (``trl_child``):
    its own CUDA context and memory, no DeepSpeed process group."""
    import subprocess

    import torch

    with tempfile.TemporaryDirectory(prefix="gpu_throughput-trl-") as d:
        f = Path(d) / "batch.pt"
        torch.save({"input_ids": batch.input_ids, "old_logprobs": batch.old_logprobs}, f)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-child", str(f), "--trl-model", str(folder),
               "--trl-device", device.type, "--trl-allowance", f"{budget.allowance(share):.1f}",
               "--rows", str(args.rows), "--prompt", str(args.prompt), "--completion", str(args.completion),
               "--micro", str(args.micro), "--reps", str(args.reps), "--threads", str(args.threads)]
        env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env,
                             timeout=max(60.0, budget.left() + 30.0))
    lines = out.stdout.strip().splitlines()
    if out.returncode or not lines:
        raise RuntimeError(f"the TRL child exited {out.returncode}: {out.stdout[-2000:]}")
    res = json.loads(lines[-1])
    for r, s in enumerate(res["times"]):
        repeats.append({"model": name, "stage": "update (TRL)", "rep": r, "s": s})
    log(f"{name}: TRL {res['trl']} update: {_median(res['times']):.3f} s ({len(res['times'])} reps)")
    # the same work as ours: the roofline belongs to the workload, not to the implementation
    return stage_row(name, "update (TRL GRPOTrainer)", args.rows * args.completion, res["times"],
                     update_passes(shape, args, ADAM_BYTES["bfloat16" if bf16 else "float32"]), roof,
                     warmup_s=res["warmup_s"], init_s=res["init_s"], trl=res["trl"],
                     checkpointing=res["checkpointing"],
                     note="bf16 autocast over fp32 weights (TRL's mixed precision)" if bf16 else "fp32")


def trl_child(args) -> None:
    """In a child process: TRL GRPOTrainer's update step on the given batch, as
    ``update_throughput.trl_child`` drives it (on ``--trl-device``; bf16 autocast on a GPU). Prints
    one JSON line: the timed repeats' seconds, the warm-up's, TRL's version."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    import update_throughput

    device = torch.device(args.trl_device)
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(args.threads)
    pinned = [p.split("==")[1] for p in update_throughput.TRL_PINS if p.startswith("trl==")]
    if pinned and trl.__version__ != pinned[0]:
        log(f"warning: TRL {trl.__version__}; bench/update_throughput.py pins {pinned[0]}")

    class FixedBatchGRPO(GRPOTrainer):
        """``_prepare_inputs`` (generate, score, advantages) replaced: the micro-batch is given."""

        def _prepare_inputs(self, inputs):  # type: ignore[override]
            return inputs

    batch = torch.load(args.trl_child)
    ids, old = batch["input_ids"], batch["old_logprobs"]
    p, rows, micro = args.prompt, args.rows, args.micro
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.trl_model)
    model = AutoModelForCausalLM.from_pretrained(args.trl_model, dtype=torch.float32)
    model.config.use_cache = False
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=rows // micro,
                         num_generations=2, learning_rate=1e-6, weight_decay=0.0, max_grad_norm=1.0, beta=0.0,
                         epsilon=0.2, epsilon_high=0.2, loss_type="dapo", temperature=1.0, use_cpu=not cuda,
                         bf16=cuda, gradient_checkpointing=False, report_to=[], logging_strategy="no",
                         save_strategy="no", num_iterations=1, max_completion_length=args.completion,
                         disable_dropout=True)
        data = Dataset.from_list([{"prompt": "x"}] * rows)
        trainer = FixedBatchGRPO(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                                 args=cfg, train_dataset=data, processing_class=tok)
        trainer.create_optimizer_and_scheduler(num_training_steps=args.reps + 1)
        # set by Trainer's own loop, which is not run: the "dapo" loss divides by it
        trainer.current_gradient_accumulation_steps = rows // micro
        opt, model = trainer.optimizer, trainer.model
        if model.is_gradient_checkpointing:  # off, as ours: checked, not assumed
            model.gradient_checkpointing_disable()
        model.train()
        dev = next(model.parameters()).device
        mbs = []
        for a in range(0, rows, micro):
            sl = slice(a, a + micro)
            mb = {"prompt_ids": ids[sl, :p], "prompt_mask": torch.ones_like(ids[sl, :p]),
                  "completion_ids": ids[sl, p:], "completion_mask": torch.ones_like(ids[sl, p:]),
                  "advantages": torch.tensor([1.0 if i % 2 else -1.0 for i in range(a, a + micro)]),
                  "old_per_token_logps": old[sl, p:],
                  "num_items_in_batch": torch.tensor(float(rows * args.completion))}
            mbs.append({k: v.to(dev) for k, v in mb.items()})
        init_s = time.perf_counter() - t0

        def step() -> None:
            update_throughput.trl_optimizer_step(trainer, model, opt, mbs)

        warm, _ = timed(step, device)
        n = max(1, min(args.reps, int(args.trl_allowance // max(warm, 1e-6))))
        times = [timed(step, device)[0] for _ in range(n)]
    print(json.dumps({"times": times, "warmup_s": warm, "init_s": init_s, "trl": trl.__version__,
                      "torch": torch.__version__, "device": str(dev),
                      "checkpointing": bool(model.is_gradient_checkpointing)}))


# -- the table -------------------------------------------------------------------------------------

def markdown(rows: list[dict[str, Any]], roof: dict, device_name: str, dtype: str) -> str:
    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    out = [f"{device_name}, {dtype}: matmul peak {roof['matmul_flops'] / 1e12:.3g} TFLOP/s "
           f"({roof['matmul_n']}^3), copy {roof['copy_bytes_per_s'] / 1e9:.4g} GB/s (read + written)", "",
           "| model | stage | tokens | median s | tok/s | TFLOP/s | MFU | GB/s | BW share | bound | roofline share |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['stage']} | {r['tokens']} | {f(r['s'], '.4f')} | {f(r['tok_s'], ',.0f')} | "
                   f"{f(r['tflops'], '.3g')} | {f(r['mfu'], '.3f')} | {f(r['gbps'], '.4g')} | "
                   f"{f(r['bw_share'], '.3f')} | {r['bound']} | {f(r['roofline_share'], '.3f')} |")
    return "\n".join(out)


# -- main ------------------------------------------------------------------------------------------

def preflight(args) -> None:
    """Fail fast, before any GPU time is spent, on what this run needs and lacks."""
    missing = []
    for mod in ("torch", "transformers", "deepspeed", "pydantic", "yaml"):
        try:
            __import__(mod)
        except Exception as e:  # noqa: BLE001
            missing.append(f"{mod} ({type(e).__name__}: {e})")
    if missing:
        raise SystemExit("gpu_throughput: cannot import " + ", ".join(missing) + ". On the device, carry the wheels "
                         "that bench/gpu_wheels.sh gathers (bench/README.md, section 12).")
    import torch

    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("gpu_throughput: no CUDA device is visible (torch.cuda.is_available() is False, torch "
                         f"{torch.__version__}); run with --smoke for the CPU check")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.smoke or args.trl_device == "cpu":
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.trl_child:
        trl_child(args)
        return 0
    run = results_io.Run(BENCH, args)  # its load average and start time: before the imports
    if args.git_commit:
        _git_fallback(args.git_commit)
    preflight(args)
    import torch

    cuda = not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if cuda else torch.float32
    dtype_name = "bfloat16" if cuda else "float32"
    budget = Budget(args.budget_s)
    device_name = torch.cuda.get_device_name(device) if cuda else f"CPU ({results_io.machine()['cpu_model']})"
    gpu = None
    if cuda:
        props = torch.cuda.get_device_properties(device)
        gpu = {"name": props.name, "capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
               "memory_gib": round(props.total_memory / 2**30, 1), "torch_cuda": torch.version.cuda}
    # a GPU run's record is named after the card unless --tag names it: gpu_throughput-<card>-<UTC time>.json
    # (--smoke: results_io's default, "smoke" or "<tag>-smoke", git-ignored)
    tag = None if args.smoke else args.tag or "-".join(
        [re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-"), time.strftime("%Y%m%dT%H%MZ", time.gmtime())])
    log(f"{device_name}, {dtype_name}; budget {args.budget_s:.0f} s; models {args.models}")

    repeats: list[dict] = []
    roof = measure_roofline(args, device, dtype, repeats)
    log(f"roofline: matmul {roof['matmul_flops'] / 1e12:.2f} TFLOP/s, copy {roof['copy_bytes_per_s'] / 1e9:.1f} GB/s")

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_folder())
    do_trl, trl_note = (trl_available() if args.trl else (False, "not asked (--trl)"))
    if args.trl:
        log(f"TRL: {trl_note}" if do_trl else f"TRL skipped: {trl_note}")
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    models = args.models.split(",")
    costs: dict[str, tuple[float, int]] = {}  # model -> (seconds it took, parameters)
    summary: dict[str, Any] = {}

    def write() -> Path:
        summary.update({"device": device_name, "gpu": gpu, "dtype": dtype_name, "roofline": roof, "rows": rows,
                        "skipped": skipped, "trl": trl_note if args.trl else None, "budget_s": args.budget_s,
                        "elapsed_s": round(budget.elapsed(), 1), "workload": workload(args),
                        "conventions": CONVENTIONS})
        return run.write(repeats, summary, tag=tag)

    for mi, name in enumerate(models):
        params = ModelShape.from_config(_config_only(name, tok)).params
        if costs:  # the least this model costs: the previous model's set-up, warm-ups and first repeats, scaled
            prev_s, prev_p = list(costs.values())[-1]
            estimate = prev_s * params / prev_p
            if estimate > budget.left():
                why = f"estimated {estimate:.0f} s (the previous model's {prev_s:.0f} s without its extra repeats, " \
                      f"x {params / prev_p:.2f} parameters) > {budget.left():.0f} s left of the budget"
                log(f"{name}: skipped: {why}")
                skipped.append({"model": name, "why": why})
                continue
        t0 = time.monotonic()
        # the next models' set-up (build, save, trainer start; not repeats) is kept out of this one's shares
        budget.reserve = (RESERVE_S if cuda else 0.0) * (len(models) - mi - 1)
        stages_left = (3 + int(do_trl)) * (len(models) - mi)  # per model: rollout 2 (generate, choose), update 1, TRL 1
        share = 1.0 / max(1, stages_left)
        with tempfile.TemporaryDirectory(prefix="gpu_throughput-") as d:
            folder = Path(d)
            t_build, (model, shape) = timed(lambda: build_model(name, tok, device, dtype, args.seed, folder), device)
            log(f"{name}: {shape.params / 1e6:.1f} M parameters, built and saved in {t_build:.1f} s")
            rows += run_rollout(name, model, tok, shape, args, device, roof, budget, 2 * share, repeats)
            del model
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            stages_left -= 2
            row, batch = run_update(name, folder, tok, shape, args, device, roof, budget,
                                    1.0 / max(1, stages_left), repeats, bf16=cuda)
            rows.append(row)
            stages_left -= 1
            if do_trl:
                try:
                    rows.append(run_trl(name, folder, batch, shape, args, device, roof, budget,
                                        1.0 / max(1, stages_left), repeats, bf16=cuda))
                except Exception as e:  # noqa: BLE001 - TRL's API or a missing dependency: recorded, not fatal
                    note = f"TRL failed on {name}: {type(e).__name__}: {e}"
                    log(note)
                    skipped.append({"model": name, "stage": "update (TRL)", "why": note})
        took = time.monotonic() - t0
        extra = sum(r["s"] for r in repeats if r["model"] == name and r["rep"] >= 1)
        costs[name] = (took - extra, params)
        path = write()
        log(f"{name}: done in {took:.0f} s; record {path}")
    path = write()
    print(markdown(rows, roof, device_name, dtype_name))
    for s in skipped:
        print(f"\nskipped: {s}")
    print(f"\nwall {budget.elapsed():.0f} s of a {args.budget_s:.0f} s budget; record: {path}")
    if torch.distributed.is_initialized():  # DeepSpeed's one-process group
        torch.distributed.destroy_process_group()
    return 0


def _git_fallback(commit: str) -> None:
    """Where git cannot say (no .git), the record's ``git`` names ``commit`` (``--git-commit``)."""
    real = results_io.git_state

    def git_state(root: Path = results_io.ROOT) -> dict[str, Any]:
        state = real(root)
        if state.get("commit"):
            return state
        return {"commit": commit, "dirty": True, "changed": [
            "unknown: no git where this ran; the commit is the one the tree was sent from (--git-commit)"]}

    results_io.git_state = git_state  # type: ignore[assignment]


def _config_only(name: str, tok: Any) -> Any:
    """The model's config without building it (parameter counts for the budget)."""
    from transformers import Qwen2Config

    shape = dict(SHAPES[name])
    if shape["vocab_size"] is None:
        shape["vocab_size"] = len(tok)
    return Qwen2Config(**shape)


def workload(args) -> dict[str, Any]:
    return {"generate": {"rows": args.gen_rows, "prompt": args.gen_prompt, "new": args.gen_new},
            "choose": {"rows": args.choose_rows, "context": args.choose_context, "observation": args.choose_obs,
                       "candidates": args.choose_cands},
            "update": {"rows": args.rows, "prompt": args.prompt, "completion": args.completion, "micro": args.micro,
                       "zero": args.zero}}


CONVENTIONS = (
    "FLOPs: 2 x matmul weights per token fed + LM head (2 x hidden x vocab) where logits are computed + attention "
    "4 x hidden x (query, key) pairs attended per layer; update = 3 x forward. Bytes (lower bound): weights once "
    "per forward pass, KV cache read (attended context) and written; update: 3 x weights per micro-batch + AdamW "
    "30 B/param (bf16) or 28 (fp32). Roofline time per pass = max(FLOPs / matmul peak, bytes / copy bandwidth), "
    "summed over a stage's passes; decode = generate - prefill (medians per repeat).")


if __name__ == "__main__":
    sys.exit(main())
