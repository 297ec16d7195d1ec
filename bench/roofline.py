"""Physical limits: each stage's FLOPs and bytes against this CPU's measured peak (issue 44 item 3).

    nice -n 19 .venv/bin/python bench/roofline.py --smoke              # tiny model, the mechanics only
    .venv/bin/python bench/roofline.py --threads 2 --tag idle-2t        # SmolLM2, alone on an idle machine

**The machine's peak, in the same run.** A large fp32 matmul (``torch.mm`` of two ``--matmul-n``
squares, 2 n^3 FLOPs) at 1 and at 2 torch threads (and ``--threads``), best of ``--peak-reps``
-> GFLOP/s; memory bandwidth from a large tensor copy (``dst.copy_(src)`` of ``--copy-mib`` MiB
of fp32: bytes read + bytes written per second, STREAM's "copy" convention), best of
``--peak-reps``, at the same thread counts. A stage is compared with the peak and the bandwidth
measured at its own thread count (``--threads``); the machine balance is peak / bandwidth
(FLOP per byte).

**The stages** (SmolLM2-135M-Instruct by default, fp32 as everything on this machine; each timed
through this project's own code, best of ``--reps`` after one warm-up, every repeat recorded):

* ``prefill``  -- ``HFEngine.generate(max_new_tokens=1)`` over the first-turn prompts of
  ``--batch`` real BabyAI episodes (the quickstart's tasks, ``--obs-style`` observations,
  ChatML prompt with the quickstart's system prompt and ``Action:`` prefix), no kept cache;
* ``decode``   -- one decode step of ``--decode-batch`` rows at context ``--decode-context``:
  ``generate`` with ``1 + --decode-steps`` new tokens minus ``generate`` with 1, both after the
  same kept cache (one row prefilled once, its keys/values reused by every row's cache key), /
  ``--decode-steps``: the forward of one token per row, the sampling and the engine's per-step
  bookkeeping; random prompt ids (the cost does not depend on them);
* ``choose``   -- ``HFEngine.choose`` at turn ``--choose-turn`` of the same ``--batch`` episodes
  (a scripted "turn left" before it, so no episode ends): the conversation up to the previous
  turn is a kept cache, so the call prefills the new tokens (the last reply, template glue, the
  observation) then runs one forward over each row's candidate tree (the distinct proper
  prefixes of the valid actions' reply ids, ``candidate_tree``, counted as the engine counts
  them); the cache is restored before every repeat;
* ``update``   -- ``PolicyTrainer.train_on_batch`` (DeepSpeed ZeRO ``--zero``, 0 by default as
  ``trainer.zero_stage: auto`` runs one rank, fp32, one optimizer step,
  micro-batches of ``--update-micro`` rows, gradient checkpointing off) driven by
  ``bench/update_throughput.py``'s own ``Ours`` on its ``make_batch`` batch (``--update-rows``
  rows of ``--update-prompt`` prompt + ``--update-completion`` trained tokens), twice: with the
  top ``--train-layers`` layers trained (configs/quickstart.yaml's setting) and with every
  weight trained; the trainer's own count of trainable parameters is checked against this one.

**FLOPs, analytically from the model's config** (``ModelShape``): every matmul's 2 m n k --
the decoder layers' q/k/v/o and MLP projections, and the LM head (tied to the embedding in
SmolLM2; the embedding lookup itself is no matmul) on exactly the positions the code projects
(prefill: the last prompt token; ``choose``: every tree node; update: the trained tokens only).
**Attention FLOPs are included** and counted as the useful ones: QK^T and AV, 4 x heads x
head_dim per (query, visible key) pair per layer -- causal within a prompt, a tree node seeing
its prompt and its ancestors. What a kernel computes can be more (padded rows of a length group,
masked pairs): ``executed_flops`` in the record counts those for the prefill groups.
Element-wise work (norms, rotary, softmax, SiLU, AdamW's arithmetic) is not counted. Backward =
2x the forward's matmul and attention FLOPs of every layer that trains (weight and activation
gradients; the lowest trained layer still computes its projections' activation
gradients, which its norm's weight gradient needs), plus the LM head's activation gradient
(its weight gradient only when the tied embedding trains, i.e. all layers); below the lowest
trained layer nothing (no weight gradients, no activation gradients). The test
(tests/bench/test_roofline.py) checks these counts against ``torch.utils.flop_counter`` on the
real forward and backward.

**Bytes: the least memory traffic the computation needs** as the code structures it: every
weight read once per forward pass the code makes (one per prefill length group, one per
candidate-tree chunk, one per micro-batch), the keys/values a pass attends to read once and
the new ones written once, the logits written once; in the update also the backward's weight
reads, the gradient accumulation (read + write per micro-batch), and AdamW's step (param, grad,
two moments read, param and moments written). Activations are not counted (they are large in
prefill and training, which are compute-bound anyway), so the bandwidth share is a lower bound.

**Bound**: arithmetic intensity (FLOPs / bytes) above the machine balance -> compute-bound,
attainable = peak, the fraction is the MFU (achieved GFLOP/s / peak); below -> memory-bound,
attainable = intensity x bandwidth, the fraction is the bandwidth share (achieved bytes/s /
measured bandwidth). Where a stage reaches less than ``--profile-below`` (0.30) of its bound,
one more call runs under ``torch.profiler`` (CPU, FLOPs of matmul ops recorded; decode: the
``1 + k``-token call minus the 1-token call, per step): its top ops by self CPU time, the time
outside any op (Python and framework overhead, the profiler's own cost included) go into the
record and are printed, with a ``diagnosis``: the shares of the matmul ops (and the GFLOP/s
they reached themselves, against the peak), of the attention kernel (its GFLOP/s and, where
it reads a kept cache, its key/value GB/s against the bandwidth), of sampling and of the rest.

The record: ``bench/results/roofline-<tag>.json`` (``results_io``: config, command, commit,
machine, load at start and end, every repeat; ``--smoke``: tag ``smoke``, git-ignored).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # imported by the tests as a module
    sys.path.insert(0, str(HERE))

import results_io  # noqa: E402

#: configs/quickstart.yaml's training tasks (AgentGym data_idx; level = idx % 40 + 1)
QUICKSTART_TASKS = [0, 1, 2, 4, 8, 9, 10, 40, 41, 42, 44, 48, 49, 50, 80, 81, 82, 84, 88, 89, 90]
#: configs/quickstart.yaml's system prompt and reply format
SYSTEM_PROMPT = "You are in a grid world. Reach the goal. Each turn, reply with one of the available actions."
RESPONSE_PREFIX = "Action:"
STOP = ["\n"]
#: configs/quickstart.yaml's trainer.train_layers
QUICKSTART_TRAIN_LAYERS = 8
BYTES = 4  # fp32
STAGES = ("prefill", "decode", "choose", "update-top", "update-all")


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2, tiny or a local HF folder")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the stages (the peak is measured "
                    "at 1, 2 and this; on a machine shared with other work use 1 and OMP_WAIT_POLICY=PASSIVE)")
    ap.add_argument("--reps", type=int, default=3, help="timed repeats per stage, after one warm-up")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma list of {', '.join(STAGES)}")
    ap.add_argument("--batch", type=int, default=8, help="BabyAI episodes (distinct tasks) of prefill and choose")
    ap.add_argument("--obs-style", default="agentgym", choices=["agentgym", "compact"],
                    help="BabyAI observations: agentgym (AgentGym's text) or compact (the quickstart's, fewer tokens)")
    ap.add_argument("--choose-turn", type=int, default=3, help="the turn choose is timed at (1 = no kept cache)")
    ap.add_argument("--decode-batch", type=int, default=16)
    ap.add_argument("--decode-context", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--update-rows", type=int, default=4)
    ap.add_argument("--update-prompt", type=int, default=192)
    ap.add_argument("--update-completion", type=int, default=64)
    ap.add_argument("--update-micro", type=int, default=1, help="micro-batch rows (configs/quickstart.yaml: 1)")
    ap.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                    help="the update's DeepSpeed ZeRO stage (0: what trainer.zero_stage auto runs for one rank)")
    ap.add_argument("--train-layers", type=int, default=QUICKSTART_TRAIN_LAYERS,
                    help="update-top trains this many top layers (configs/quickstart.yaml: 8)")
    ap.add_argument("--matmul-n", type=int, default=2048)
    ap.add_argument("--copy-mib", type=int, default=256)
    ap.add_argument("--peak-reps", type=int, default=5)
    ap.add_argument("--profile-below", type=float, default=0.30,
                    help="profile a stage that reaches less than this fraction of its bound")
    ap.add_argument("--smoke", action="store_true", help="the tiny model at toy sizes: the mechanics, < 60 s")
    results_io.add_tag_argument(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.reps, args.batch, args.choose_turn = "tiny", 1, 2, 2
        args.decode_batch, args.decode_context, args.decode_steps = 2, 48, 3
        args.update_rows, args.update_prompt, args.update_completion, args.update_micro = 2, 24, 8, 1
        args.train_layers = 1
        args.matmul_n, args.copy_mib, args.peak_reps = 256, 16, 2
    return args


# -------------------------------------------------------------------------------------------
# Analytic FLOPs and bytes (no torch)
# -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP and byte counts need of a decoder-only transformer's config."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = True
    #: biases on q, k, v (Qwen2 always; Llama where ``attention_bias``): parameters, no matmul FLOPs
    qkv_bias: bool = False
    #: bytes per weight and per cached key/value element: fp32 here; gpu_throughput.py runs bf16 (2)
    dtype_bytes: int = BYTES

    @classmethod
    def from_config(cls, cfg: Any, dtype_bytes: int = BYTES) -> "ModelShape":
        heads = cfg.num_attention_heads
        bias = getattr(cfg, "attention_bias", None)
        return cls(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, heads=heads,
                   kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                   intermediate=cfg.intermediate_size, vocab=cfg.vocab_size,
                   tied=bool(getattr(cfg, "tie_word_embeddings", False)),
                   qkv_bias=bool(bias) if bias is not None else getattr(cfg, "model_type", "") == "qwen2",
                   dtype_bytes=dtype_bytes)

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one decoder layer's matmuls: q, k, v, o and the gated MLP (gate, up, down)."""
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return d * q + 2 * d * kv + q * d + 3 * d * self.intermediate

    @property
    def layer_params(self) -> int:
        """All of a layer's weights: the matmuls, its two RMSNorm weights, q/k/v biases if any."""
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return self.layer_matmul_params + 2 * self.hidden + bias

    @property
    def head_params(self) -> int:
        """The LM head's weights (vocab x hidden; the embedding's when tied)."""
        return self.vocab * self.hidden

    @property
    def matmul_params(self) -> int:
        """Every matmul weight of a forward over all positions: the layers and the LM head."""
        return self.layers * self.layer_matmul_params + self.head_params

    @property
    def params(self) -> int:
        """Every parameter, as the model counts them: the layers, the final norm, the embedding and,
        when untied, the LM head as a second matrix."""
        return self.layers * self.layer_params + self.hidden + self.head_params * (1 if self.tied else 2)

    @property
    def attn_flops_per_pair(self) -> int:
        """QK^T and AV: 2 x head_dim each, per head, per (query, visible key) pair, one layer."""
        return 4 * self.heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one position in every layer (``dtype_bytes`` each)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        """What one forward pass reads of the weights: the layers, the final norm, the LM head."""
        return self.dtype_bytes * (self.layers * self.layer_params + self.hidden + self.head_params)


def causal_pairs(new: int, cached: int = 0) -> int:
    """(query, key) pairs of ``new`` tokens after ``cached`` ones under a causal mask: token j
    (0-based) sees the cache and the new tokens up to itself."""
    return new * cached + new * (new + 1) // 2


@dataclass
class Cost:
    """One stage's counts: useful FLOPs (their parts) and the least bytes moved (their parts)."""

    flops: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, float] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def total_flops(self) -> float:
        return float(sum(self.flops.values()))

    @property
    def total_bytes(self) -> float:
        return float(sum(self.bytes.values()))

    def add(self, other: "Cost") -> "Cost":
        for mine, theirs in ((self.flops, other.flops), (self.bytes, other.bytes)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0.0) + v
        return self

    def as_dict(self) -> dict[str, Any]:
        return {"flops": self.total_flops, "bytes": self.total_bytes, "flops_parts": self.flops,
                "bytes_parts": self.bytes, **self.detail}


def forward_flops(m: ModelShape, tokens: int, pairs: int, head_positions: int, layers: int | None = None) -> dict:
    """One forward's FLOPs: ``tokens`` positions through ``layers`` (default all) decoder layers,
    ``pairs`` attention (query, key) pairs per layer, the LM head on ``head_positions``."""
    n = m.layers if layers is None else layers
    return {"matmul": 2.0 * n * m.layer_matmul_params * tokens, "attention": float(n * m.attn_flops_per_pair * pairs),
            "lm_head": 2.0 * m.head_params * head_positions}


def prefill_cost(m: ModelShape, lengths: list[int], forwards: int = 1, padded_to: list[int] | None = None) -> Cost:
    """Prefill of prompts of ``lengths`` tokens (no kept cache), the LM head on each row's last
    token; ``forwards`` passes (length groups), each reading the weights. ``padded_to``: each
    row's computed width (its group's longest) for the ``executed`` count."""
    c = Cost()
    c.flops.update(forward_flops(m, sum(lengths), sum(causal_pairs(n) for n in lengths), len(lengths)))
    c.bytes = {"weights": float(forwards * m.weight_bytes), "kv_write": float(sum(lengths) * m.kv_bytes_per_token),
               "logits": float(len(lengths) * m.vocab * BYTES)}
    widths = padded_to or lengths
    executed = forward_flops(m, sum(widths), sum(w * w for w in widths), len(lengths))
    c.detail = {"rows": len(lengths), "tokens": sum(lengths), "lengths": list(lengths), "forwards": forwards,
                "padded_tokens": sum(widths) - sum(lengths), "executed_flops": float(sum(executed.values()))}
    return c


def decode_cost(m: ModelShape, contexts: list[int]) -> Cost:
    """One decode step: one token per row, row ``i`` attending to ``contexts[i]`` cached positions
    and itself; weights read once, each row's cache read once and its new keys/values written."""
    c = Cost()
    rows = len(contexts)
    c.flops.update(forward_flops(m, rows, sum(ctx + 1 for ctx in contexts), rows))
    c.bytes = {"weights": float(m.weight_bytes), "kv_read": float(sum(contexts) * m.kv_bytes_per_token),
               "kv_write": float(rows * m.kv_bytes_per_token), "logits": float(rows * m.vocab * BYTES)}
    c.detail = {"rows": rows, "mean_context": sum(contexts) / max(rows, 1)}
    return c


def tree_depths(parents: list[int]) -> list[int]:
    """Depth (1 = a child of the prompt) of each node of a ``candidate_tree``."""
    depth: list[int] = []
    for par in parents:  # parents come before children
        depth.append(depth[par] + 1 if par >= 0 else 1)
    return depth


def choose_cost(m: ModelShape, cached: list[int], new: list[int], depths: list[list[int]],
                prefill_forwards: int, tree_forwards: int) -> Cost:
    """``HFEngine.choose`` for rows with ``cached`` kept positions and ``new`` prompt tokens to
    prefill, then a forward over each row's candidate tree (``depths[i]``: each node's depth):
    a node sees its prompt (``cached + new``) and its ancestors and itself; the LM head runs on
    the prompt's last token and on every node."""
    c = Cost()
    pairs = sum(causal_pairs(n, k) for n, k in zip(new, cached))
    pre = forward_flops(m, sum(new), pairs, len(new))
    nodes = sum(len(d) for d in depths)
    tree_pairs = sum(len(d) * (k + n) + sum(d) for d, k, n in zip(depths, cached, new))
    tree = forward_flops(m, nodes, tree_pairs, nodes)
    c.flops = {f"prefill_{k}": v for k, v in pre.items()} | {f"tree_{k}": v for k, v in tree.items()}
    kv = m.kv_bytes_per_token
    c.bytes = {"weights": float((prefill_forwards + tree_forwards) * m.weight_bytes),
               "kv_read": float((sum(cached) + sum(k + n for k, n in zip(cached, new))) * kv),
               "kv_write": float((sum(new) + nodes) * kv), "logits": float((len(new) + nodes) * m.vocab * BYTES)}
    c.detail = {"rows": len(new), "cached_tokens": sum(cached), "new_tokens": sum(new), "tree_nodes": nodes,
                "cached": list(cached), "new": list(new), "nodes": [len(d) for d in depths],
                "prefill_forwards": prefill_forwards, "tree_forwards": tree_forwards}
    return c


def trained_params(m: ModelShape, train_layers: int | None) -> int:
    """Parameters the optimizer steps: the top ``train_layers`` layers and the final norm
    (``freeze_below``), or every weight (``None``; the tied embedding counted once)."""
    if train_layers is None:
        return m.layers * m.layer_params + m.hidden + m.head_params
    return train_layers * m.layer_params + m.hidden


def update_cost(m: ModelShape, seq_lens: list[int], policy_tokens: int, micro_batches: int,
                train_layers: int | None, optimizer_steps: int = 1) -> Cost:
    """``PolicyTrainer.train_on_batch``: a forward over every row (``seq_lens``: the unpadded
    lengths; micro-batches of equal rows carry no padding) with the LM head on the
    ``policy_tokens`` only, then the backward: weight and activation gradients (2x the forward
    matmul and attention FLOPs) for the top ``train_layers`` layers (``None``: all), the LM
    head's activation gradient, and its weight gradient when the tied embedding trains (all
    layers); nothing below the lowest trained layer. Bytes: the weights read per micro-batch
    forward and backward, the gradients accumulated per micro-batch, AdamW per step."""
    k = m.layers if train_layers is None else train_layers
    tokens, pairs = sum(seq_lens), sum(causal_pairs(s) for s in seq_lens)
    fwd = forward_flops(m, tokens, pairs, policy_tokens)
    bwd_layers = forward_flops(m, tokens, pairs, 0, layers=k)
    head_grads = 2 if train_layers is None else 1  # activation gradient, + weight gradient when trained
    c = Cost()
    c.flops = {f"forward_{x}": v for x, v in fwd.items()}
    c.flops["backward_matmul"] = 2 * bwd_layers["matmul"]
    c.flops["backward_attention"] = 2 * bwd_layers["attention"]
    c.flops["backward_lm_head"] = head_grads * fwd["lm_head"]
    n_train = trained_params(m, train_layers)
    bwd_weights = m.dtype_bytes * (k * m.layer_params + m.hidden + m.head_params)  # the layers that pass gradients on
    c.bytes = {"weights_forward": float(micro_batches * m.weight_bytes),
               "weights_backward": float(micro_batches * bwd_weights),
               "grad_accumulate": float(micro_batches * 2 * BYTES * n_train),
               "optimizer": float(optimizer_steps * 8 * BYTES * n_train)}  # grad norm + AdamW: 5 reads, 3 writes
    c.detail = {"rows": len(seq_lens), "tokens": tokens, "policy_tokens": policy_tokens,
                "micro_batches": micro_batches, "train_layers": k, "trained_params": n_train}
    return c


def roofline(flops: float, nbytes: float, seconds: float, peak_gflops: float, bandwidth_gbs: float) -> dict:
    """Achieved rates, MFU, bandwidth share, and which bound applies (intensity vs balance)."""
    gflops = flops / seconds / 1e9
    gbs = nbytes / seconds / 1e9
    intensity = flops / nbytes if nbytes else math.inf
    balance = peak_gflops / bandwidth_gbs
    compute = intensity >= balance
    mfu, share = gflops / peak_gflops, gbs / bandwidth_gbs
    return {"seconds": seconds, "gflops": gflops, "mfu": mfu, "gbs": gbs, "bandwidth_share": share,
            "intensity": intensity, "balance": balance, "bound": "compute" if compute else "memory",
            "of_bound": mfu if compute else share}


# -------------------------------------------------------------------------------------------
# The machine's peak
# -------------------------------------------------------------------------------------------


def measure_peak(threads: list[int], n: int, copy_mib: int, reps: int) -> dict[str, Any]:
    """Best-of-``reps`` fp32 matmul GFLOP/s and copy GB/s (read + written) at each thread count."""
    import torch

    out: dict[str, Any] = {"matmul_n": n, "copy_mib": copy_mib, "reps": reps, "by_threads": {}}
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    c = torch.empty(n, n)
    src = torch.ones(copy_mib << 18)  # MiB of fp32
    dst = torch.empty_like(src)
    before = torch.get_num_threads()
    for t in threads:
        torch.set_num_threads(t)
        torch.mm(a, b, out=c)
        dst.copy_(src)  # warm: pages touched, threads started
        mm_s, cp_s = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(a, b, out=c)
            mm_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            dst.copy_(src)
            cp_s.append(time.perf_counter() - t0)
        out["by_threads"][str(t)] = {
            "matmul_s": mm_s, "copy_s": cp_s, "gflops": 2.0 * n ** 3 / min(mm_s) / 1e9,
            "gbs": 2.0 * src.numel() * BYTES / min(cp_s) / 1e9}
    torch.set_num_threads(before)
    return out


# -------------------------------------------------------------------------------------------
# Workloads through the project's code
# -------------------------------------------------------------------------------------------


@dataclass
class Episode:
    """One scripted BabyAI episode: the prompt and candidate reply ids of each turn."""

    task: int
    prompts: list[list[int]]
    choices: list[list[list[int]]]


def babyai_episodes(tokenizer: Any, n: int, turns: int, style: str) -> list[Episode]:
    """``n`` quickstart BabyAI tasks played ``turns`` turns by "turn left" (never ends an episode),
    as the rollout builds them: ``ChatFormatter`` prompts with the ``Action:`` prefix, glue after
    each reply, and each turn's valid actions as reply ids (``action_reply_ids``)."""
    from agentgym.chat import ChatFormatter
    from env_adapters.babyai import BabyAIEnv

    fmt = ChatFormatter(tokenizer, response_prefix=RESPONSE_PREFIX)
    env = BabyAIEnv(observation_style=style)
    out = []
    try:
        seen: set[tuple[int, ...]] = set()
        for task in QUICKSTART_TASKS:
            if len(out) == n:
                break
            obs, _ = env.reset(task, 0)
            ids = fmt.start(SYSTEM_PROMPT, obs)
            if tuple(ids) in seen:  # the engine would prefill a repeated prompt once
                continue
            seen.add(tuple(ids))
            ep = Episode(task, [], [])
            for t in range(turns):
                acts = env.valid_actions() or []
                ep.prompts.append(list(ids))
                ep.choices.append([fmt.action_reply_ids(a, STOP) for a in acts])
                if t == turns - 1:
                    break
                action = "turn left" if "turn left" in acts else acts[0]
                reply = fmt.action_reply_ids(action, STOP)
                res = env.step(fmt.reply_text(reply))
                if res.terminated or res.truncated:
                    raise RuntimeError(f"BabyAI task {task} ended at turn {t + 1}: pick other tasks")
                ids = ids + reply + fmt.glue_step(res.observation, res.info, fmt.ends_turn(reply))
            out.append(ep)
    finally:
        env.close()
    if len(out) < n:
        raise ValueError(f"only {len(out)} distinct BabyAI first prompts among the quickstart's tasks; use --batch <= {len(out)}")
    return out


def best_of(fn: Callable[[int], float], reps: int) -> list[float]:
    """``fn(rep)`` returns the seconds of one timed call; one warm-up (rep -1), then ``reps``."""
    fn(-1)
    return [fn(r) for r in range(reps)]


def _op_times(fn: Callable[[], Any]) -> tuple[float, dict[str, dict[str, float]]]:
    """One call of ``fn`` under torch.profiler (CPU, matmul FLOPs recorded): its wall seconds and,
    per op, calls, self CPU seconds and FLOPs."""
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        fn()
    wall = time.perf_counter() - t0
    ops = {e.key: {"calls": float(e.count), "self_s": e.self_cpu_time_total / 1e6,
                   "flops": float(getattr(e, "flops", 0) or 0)} for e in prof.key_averages()}
    return wall, ops


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def profile_call(fn: Callable[[], Any], baseline: Callable[[], Any] | None = None, per: int = 1,
                 top: int = 12) -> dict[str, Any]:
    """Where a stage's time goes: one call of ``fn`` under torch.profiler, its top ops by self
    CPU time, the time outside every op (Python and framework overhead; the profiler's own
    per-op cost lands there too) and the GFLOP/s the matmul ops themselves reached. With
    ``baseline``, the per-op differences ``fn`` - ``baseline`` divided by ``per`` (decode: the
    ``1 + k``-token call minus the 1-token call, per step)."""
    import torch

    wall, ops = _op_times(fn)
    if baseline is not None:
        wall0, ops0 = _op_times(baseline)
        wall -= wall0
        for k, v in ops0.items():
            mine = ops.setdefault(k, {"calls": 0.0, "self_s": 0.0, "flops": 0.0})
            for f in mine:
                mine[f] -= v[f]
    wall /= per
    ops = {k: {f: x / per for f, x in v.items()} for k, v in ops.items()}
    total = sum(v["self_s"] for v in ops.values())
    ranked = sorted(ops.items(), key=lambda kv: -kv[1]["self_s"])
    mm_s = sum(ops[k]["self_s"] for k in MATMUL_OPS if k in ops)
    mm_flops = sum(ops[k]["flops"] for k in MATMUL_OPS if k in ops)
    attn_s = sum(v["self_s"] for k, v in ops.items() if "scaled_dot_product" in k or "flash_attention" in k)
    return {
        "wall_s": wall, "per": per, "difference": baseline is not None, "ops_self_s": total,
        "outside_ops_s": max(wall - total, 0.0),
        "matmul_ops": {"self_s": mm_s, "share": mm_s / wall if wall else 0.0, "flops": mm_flops,
                       "gflops": mm_flops / mm_s / 1e9 if mm_s > 0 else None},
        "attention_ops": {"self_s": attn_s, "share": attn_s / wall if wall else 0.0},
        "top": [{"op": k, "calls": v["calls"], "self_s": v["self_s"], "share": v["self_s"] / wall if wall else 0.0}
                for k, v in ranked[:top]],
        "threads": torch.get_num_threads(),
    }


SAMPLING_OPS = ("aten::exponential_", "aten::multinomial", "aten::uniform_", "aten::argmax")


def diagnose(profile: dict[str, Any], cost: Cost, peak_gflops: float, bandwidth_gbs: float) -> dict[str, Any]:
    """The profile read against the roofline: each part's share of the stage's time and, where
    it has a physical measure, how close that part itself runs to it -- the matmul ops' GFLOP/s
    against the peak, the attention kernel's FLOPs and key/value bytes per second, the sampling
    ops, the time outside every op (Python, framework, the profiler's own cost)."""
    wall = profile["wall_s"] or 1e-12
    top = {t["op"]: t for t in profile["top"]}
    mm = profile["matmul_ops"]
    attn_s = profile["attention_ops"]["self_s"]
    attn_flops = sum(v for k, v in cost.flops.items() if "attention" in k)  # the kernel's time: forward + backward
    kv_bytes = cost.bytes.get("kv_read", 0.0)
    sampling_s = sum(top[k]["self_s"] for k in SAMPLING_OPS if k in top)
    parts = {
        "matmul_ops": {"share": mm["self_s"] / wall, "gflops": mm["gflops"],
                       "of_peak": (mm["gflops"] / peak_gflops) if mm["gflops"] else None},
        "attention_kernel": {"share": attn_s / wall,
                             "gflops": attn_flops / attn_s / 1e9 if attn_s > 0 and attn_flops else None,
                             "kv_gbs": kv_bytes / attn_s / 1e9 if attn_s > 0 and kv_bytes else None},
        "sampling_ops": {"share": sampling_s / wall},
        "outside_ops": {"share": profile["outside_ops_s"] / wall},
    }
    kv = parts["attention_kernel"]["kv_gbs"]
    if kv is not None:
        parts["attention_kernel"]["kv_of_bandwidth"] = kv / bandwidth_gbs
    parts["other_ops"] = {"share": max(0.0, 1.0 - sum(p["share"] for p in parts.values()))}
    return parts


class Bench:
    def __init__(self, args: argparse.Namespace):
        import torch
        from transformers import AutoConfig

        from agentgym.models.folders import resolve_model, tiny_model_path

        self.args = args
        self.path = tiny_model_path() if args.model == "tiny" else resolve_model(args.model)
        self.shape = ModelShape.from_config(AutoConfig.from_pretrained(self.path, local_files_only=True))
        self.torch = torch
        self._engine = None
        self._tok = None

    # -- the engine stages ----------------------------------------------------------------
    def engine(self):
        if self._engine is None:
            from agentgym.models.folders import load_model
            from agentgym.rollout.engines.hf import HFEngine

            model, tok = load_model(self.path, "float32")  # fp32: no native bf16 on this CPU
            self._engine, self._tok = HFEngine(model, tok), tok
        return self._engine

    def close_engine(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
            import gc

            gc.collect()

    def prefill(self, episodes: list[Episode]) -> tuple[Cost, Callable[[int], float], Callable[[], Any]]:
        from agentgym.rollout.engines import SamplingParams
        from agentgym.rollout.engines.hf import length_groups

        eng = self.engine()
        prompts = [ep.prompts[0] for ep in episodes]
        lengths = [len(p) for p in prompts]
        groups = length_groups(lengths, eng.max_padding)
        padded = [0] * len(lengths)
        for g in groups:
            for i in g:
                padded[i] = lengths[g[0]]
        cost = prefill_cost(self.shape, lengths, forwards=len(groups), padded_to=padded)

        def call(rep: int = 0) -> float:
            before = eng.prefilled_tokens
            t0 = time.perf_counter()
            eng.generate(prompts, SamplingParams(max_new_tokens=1, temperature=1.0, seed=rep))
            dt = time.perf_counter() - t0
            assert eng.prefilled_tokens - before == sum(lengths), "the engine prefilled other tokens than counted"
            return dt

        return cost, call, lambda: call(0)

    def decode(self) -> tuple[Cost, Callable[[int], float], Callable[[], Any], list]:
        """One decode step as the difference of two generate calls after the same kept cache."""
        from agentgym.rollout.engines import SamplingParams

        a, eng = self.args, self.engine()
        g = self.torch.Generator().manual_seed(1)
        base = self.torch.randint(10, self.shape.vocab, (a.decode_context,), generator=g).tolist()
        eng.generate([base], SamplingParams(max_new_tokens=1), cache_keys=["prime"])  # caches `base`
        primed = eng._prefixes["prime"]
        keys = [f"row{i}" for i in range(a.decode_batch)]
        prompts = [base + [11 + i] for i in range(a.decode_batch)]  # distinct rows, one new token each
        k = a.decode_steps
        # step s (1..k) feeds the token at position C + s and attends to C + s cached positions
        steps = [decode_cost(self.shape, [a.decode_context + s] * a.decode_batch) for s in range(1, k + 1)]
        cost = Cost()
        for s in steps:
            cost.add(s)
        cost.flops = {x: v / k for x, v in cost.flops.items()}
        cost.bytes = {x: v / k for x, v in cost.bytes.items()}
        cost.detail = {**steps[0].detail, "mean_context": a.decode_context + (k + 1) / 2, "steps": k,
                       "per": "one decode step (the mean over the timed steps)"}
        raw: list[dict] = []

        def gen(new: int, seed: int) -> float:
            eng.release(keys)
            eng._prefixes.update({key: primed for key in keys})  # every row reuses the kept cache
            t0 = time.perf_counter()
            eng.generate(prompts, SamplingParams(max_new_tokens=new, temperature=1.0, seed=seed), cache_keys=keys)
            return time.perf_counter() - t0

        def call(rep: int = 0) -> float:
            one = gen(1, rep)
            many = gen(1 + k, rep)
            raw.append({"rep": rep, "one_token_s": one, f"{1 + k}_tokens_s": many})
            return (many - one) / k

        # profiled: the (1 + k)-token call minus the 1-token call, per step
        self.decode_profile = {"baseline": lambda: gen(1, 0), "per": k}
        return cost, call, lambda: gen(1 + k, 0), raw

    def choose(self, episodes: list[Episode]) -> tuple[Cost, Callable[[int], float], Callable[[], Any]]:
        from agentgym.rollout.engines import SamplingParams
        from agentgym.rollout.engines.hf import candidate_tree, length_groups

        a, eng = self.args, self.engine()
        t = a.choose_turn - 1
        keys = [f"ep{ep.task}" for ep in episodes]
        prompts = [ep.prompts[t] for ep in episodes]
        choices = [ep.choices[t] for ep in episodes]
        cached = [0] * len(episodes)
        if t > 0:  # the previous turn's call leaves its prompt cached, as in a rollout
            eng.choose([ep.prompts[t - 1] for ep in episodes], [ep.choices[t - 1] for ep in episodes],
                       SamplingParams(temperature=1.0), cache_keys=keys)
            cached = [len(ep.prompts[t - 1]) for ep in episodes]
        snapshot = {k: eng._prefixes[k] for k in keys if k in eng._prefixes}
        new = [len(p) - c for p, c in zip(prompts, cached)]
        trees = [candidate_tree(c) for c in choices]
        depths = [tree_depths(tr[1]) for tr in trees]
        sizes = [len(tr[0]) for tr in trees]
        tree_forwards = 0
        for grp in length_groups(sizes, eng.max_padding):  # as _candidate_logprobs chunks them
            t_max = sizes[grp[0]]
            if t_max:
                tree_forwards += math.ceil(len(grp) / max(1, eng.max_scoring_logits // (t_max * self.shape.vocab)))
        cost = choose_cost(self.shape, cached, new, depths,
                           prefill_forwards=len(length_groups(new, eng.max_padding)), tree_forwards=tree_forwards)
        cost.detail.update({"turn": a.choose_turn, "candidates": sum(len(c) for c in choices),
                            "prompt_tokens": sum(map(len, prompts))})

        def call(rep: int = 0) -> float:
            eng.release(keys)
            eng._prefixes.update(snapshot)
            before = eng.prefilled_tokens
            t0 = time.perf_counter()
            eng.choose(prompts, choices, SamplingParams(temperature=1.0, seed=rep), cache_keys=keys)
            dt = time.perf_counter() - t0
            assert eng.prefilled_tokens - before == sum(new) + sum(sizes), "choose computed other tokens than counted"
            return dt

        return cost, call, lambda: call(0)

    # -- the update stages ----------------------------------------------------------------
    def update(self, train_layers: int | None) -> tuple[Cost, Callable[[int], float], Callable[[], Any], Any]:
        """``PolicyTrainer.train_on_batch`` driven by ``bench/update_throughput.py``'s own ``Ours``
        on its ``make_batch`` batch (ZeRO-2, fp32, checkpointing off, one optimizer step), with the
        top ``train_layers`` layers trained (``None``: all)."""
        import update_throughput as ut

        a = self.args
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        batch = ut.make_batch(self.path, a.update_rows, a.update_prompt, a.update_completion)
        layers = "all" if train_layers is None else f"top{train_layers}"
        side = ut.Ours(self.path, batch, argparse.Namespace(zero=a.zero, micro=a.update_micro, checkpointing="off",
                                                            layers=layers))
        seq = [a.update_prompt + a.update_completion] * a.update_rows
        policy = int(side.batch.loss_mask[:, 1:].sum())
        cost = update_cost(self.shape, seq, policy, math.ceil(a.update_rows / a.update_micro), train_layers)
        cost.detail["trainer"] = dict(side.info)
        if side.info.get("trainable_params") != cost.detail["trained_params"]:
            print(f"warning: the trainer trains {side.info.get('trainable_params')} parameters, the count "
                  f"{cost.detail['trained_params']}", file=sys.stderr)
        if side.info.get("checkpointing"):
            raise RuntimeError("gradient checkpointing is on: the FLOP count assumes it off")

        def call(rep: int = 0) -> float:
            return side.step()

        return cost, call, lambda: call(0), side


# -------------------------------------------------------------------------------------------
# The run
# -------------------------------------------------------------------------------------------


def _fmt(x: float, unit: str = "") -> str:
    for scale, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {p}{unit}".strip()
    return f"{x:.3g} {unit}".strip()


def table(rows: list[dict]) -> str:
    head = ["stage", "FLOPs", "bytes", "seconds", "GFLOP/s", "MFU", "GB/s", "bandwidth share", "bound",
            "FLOP/byte", "of bound"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---:|" * (len(head) - 3)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["stage"], _fmt(r["flops"]), _fmt(r["bytes"], "B"), f"{r['seconds']:.4g}", f"{r['gflops']:.3g}",
            f"{100 * r['mfu']:.1f} %", f"{r['gbs']:.3g}", f"{100 * r['bandwidth_share']:.1f} %", r["bound"],
            f"{r['intensity']:.3g}", f"{100 * r['of_bound']:.1f} %"]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.manual_seed(0)
    run = results_io.Run("roofline", args)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise SystemExit(f"unknown stages {sorted(unknown)}; choose from {', '.join(STAGES)}")
    t_start = time.perf_counter()
    peak = measure_peak(sorted({1, 2, args.threads}), args.matmul_n, args.copy_mib, args.peak_reps)
    at = peak["by_threads"][str(args.threads)]
    for t, p in peak["by_threads"].items():
        print(f"peak at {t} thread(s): matmul {p['gflops']:.1f} GFLOP/s, copy {p['gbs']:.2f} GB/s "
              f"(balance {p['gflops'] / p['gbs']:.2f} FLOP/byte)", file=sys.stderr, flush=True)
    torch.set_num_threads(args.threads)

    bench = Bench(args)
    print(f"model {bench.path.name}: {asdict(bench.shape)}", file=sys.stderr, flush=True)
    rows: list[dict] = []
    repeats: list[dict] = []
    extra_raw: dict[str, Any] = {}

    def measure(stage: str, cost: Cost, call: Callable[[int], float], once: Callable[[], Any],
                profile_kw: dict | None = None) -> None:
        secs = best_of(call, args.reps)
        repeats.extend({"stage": stage, "rep": i, "s": s} for i, s in enumerate(secs))
        row = {"stage": stage, **cost.as_dict(),
               **roofline(cost.total_flops, cost.total_bytes, min(secs), at["gflops"], at["gbs"])}
        row["median_s"] = sorted(secs)[len(secs) // 2]
        if row["of_bound"] < args.profile_below:
            row["profile"] = profile_call(once, **(profile_kw or {}))
            pr = row["profile"]
            pr["diagnosis"] = diagnose(pr, cost, at["gflops"], at["gbs"])
            mm = pr["matmul_ops"]
            print(f"[{stage}] {100 * row['of_bound']:.1f} % of its {row['bound']} bound -> profile"
                  f"{' (per step)' if pr['difference'] else ''}: wall "
                  f"{pr['wall_s']:.3f} s, matmul ops {100 * mm['share']:.0f} % at "
                  f"{mm['gflops'] or 0:.1f} GFLOP/s, outside ops {pr['outside_ops_s']:.3f} s; top: "
                  + ", ".join(f"{t['op']} {100 * t['share']:.0f} %" for t in pr["top"][:6]), file=sys.stderr, flush=True)
        rows.append(row)
        print(f"[{stage}] best {min(secs):.4f} s of {[round(s, 4) for s in secs]}: {row['gflops']:.2f} GFLOP/s "
              f"({100 * row['mfu']:.1f} % MFU), {row['gbs']:.2f} GB/s, {row['bound']}-bound",
              file=sys.stderr, flush=True)

    need_eps = any(s in stages for s in ("prefill", "choose"))
    if need_eps or "decode" in stages:
        bench.engine()
    episodes = babyai_episodes(bench._tok, args.batch, max(args.choose_turn, 1), args.obs_style) if need_eps else []
    if "prefill" in stages:
        measure("prefill", *bench.prefill(episodes))
    if "decode" in stages:
        cost, call, once, raw = bench.decode()
        measure("decode", cost, call, once, bench.decode_profile)
        extra_raw["decode_calls"] = raw
    if "choose" in stages:
        measure("choose", *bench.choose(episodes))
    bench.close_engine()
    for stage, layers in (("update-top", args.train_layers), ("update-all", None)):
        if stage not in stages:
            continue
        cost, call, once, side = bench.update(layers)
        label = f"update, top {layers} layers" if layers is not None else "update, all layers"
        measure(stage, cost, call, once)
        rows[-1]["label"] = label
        side.close()
        del side

    # the peak again: a machine whose load changed during the run shows it here (not used above)
    peak_end = measure_peak([args.threads], args.matmul_n, args.copy_mib, args.peak_reps)["by_threads"][str(args.threads)]
    drift = {"gflops": peak_end["gflops"] / at["gflops"], "gbs": peak_end["gbs"] / at["gbs"]}
    if any(abs(v - 1.0) > 0.1 for v in drift.values()):
        print(f"warning: the peak at the end differs from the start's by more than 10 % (matmul x{drift['gflops']:.2f}, "
              f"copy x{drift['gbs']:.2f}): the machine's load changed; rerun on an idle machine", file=sys.stderr)

    print(f"\nroofline: {bench.path.name}, fp32, {args.threads} thread(s), best of {args.reps}; peak "
          f"{at['gflops']:.1f} GFLOP/s, bandwidth {at['gbs']:.2f} GB/s, balance {at['gflops'] / at['gbs']:.2f} "
          f"FLOP/byte (load {os.getloadavg()[0]:.2f})\n")
    print(table(rows))
    results = {"peak": peak, "peak_end": peak_end, "peak_drift": drift, "threads": args.threads, "shape": asdict(bench.shape), "rows": rows,
               "decode_calls": extra_raw.get("decode_calls"), "bench_s": time.perf_counter() - t_start}
    out = run.write(repeats, results)
    try:
        shown = out.relative_to(results_io.ROOT)
    except ValueError:
        shown = out
    print(f"\nrecord: {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
