"""KV cache of a multi-turn decode: ``ReservedLayer`` (write in place) vs transformers' ``DynamicLayer`` (cat).

    .venv/bin/python bench/kv_cache_decode.py                        # SmolLM2, 16 rows, context 250..2000, ~3 min
    .venv/bin/python bench/kv_cache_decode.py --model tiny --contexts 500 2000

Part of issue #10's rollout work. A rollout turn decodes its reply over the whole conversation
kept from earlier turns (``HFEngine``, ``cache_keys``). ``DynamicLayer.update`` ``torch.cat``s the
new token's keys/values onto each layer's entire cache, a copy of O(context) per generated token
per layer; ``agentgym.rollout.engines.hf.ReservedLayer`` writes them into room reserved for the turn's
reply. Both sides decode the same ``--steps`` tokens for ``--rows`` rows after a cache of
``--context`` positions (random keys/values: the cost does not depend on them), alternated,
best of ``--reps``; the logits of the last step must be equal (they are bit-identical: the
attention reads the same numbers). Ratio = DynamicLayer ms per step / ReservedLayer ms per step
(>1: ours is faster). No target in the issue: a figure. Every rep's ms per step goes into
``bench/results/kv_cache_decode-<tag>.json`` (``results_io``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2 or tiny (or an HF folder)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--contexts", type=int, nargs="+", default=[250, 500, 1000, 2000])
    ap.add_argument("--steps", type=int, default=24, help="decode steps (a reply's tokens)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: see bench/README.md)")
    ap.add_argument("--tag", default="", help="the record's name: bench/results/kv_cache_decode-<tag>.json "
                    "(default: the UTC time)")
    return ap.parse_args()


ARGS = _parse()
os.environ.setdefault("OMP_NUM_THREADS", str(ARGS.threads))


def main() -> int:
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    import benchlib
    from agentgym.rollout.engines.hf import reserved_cache
    from agentgym.models.folders import resolve_model
    from benchlib import Row

    torch.set_num_threads(ARGS.threads)
    run = benchlib.start("kv_cache_decode", ARGS)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(ARGS.model), dtype=torch.float32).eval()
    cfg = model.config
    heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    n, steps = ARGS.rows, ARGS.steps
    rows, per_ctx, repeats = [], {}, []
    for ctx in ARGS.contexts:
        g = torch.Generator().manual_seed(ctx)
        kv = [(torch.randn(n, heads, ctx, head_dim, generator=g), torch.randn(n, heads, ctx, head_dim, generator=g))
              for _ in range(cfg.num_hidden_layers)]

        def decode(kind: str) -> tuple[float, torch.Tensor]:
            if kind == "dynamic":
                cache = DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in kv])
            else:
                data = []
                for k, v in kv:
                    kb, vb = k.new_empty((n, heads, ctx + steps, head_dim)), v.new_empty((n, heads, ctx + steps, head_dim))
                    kb[:, :, :ctx], vb[:, :, :ctx] = k, v
                    data.append((kb, vb, ctx))
                cache = reserved_cache(data, steps)
            attn = torch.ones((n, ctx), dtype=torch.long)
            pos = torch.full((n, 1), ctx)
            tok = torch.zeros((n, 1), dtype=torch.long)
            t0 = time.perf_counter()
            with torch.no_grad():
                for _ in range(steps):
                    attn = torch.cat([attn, attn.new_ones((n, 1))], -1)
                    logits = model(input_ids=tok, attention_mask=attn, position_ids=pos, use_cache=True,
                                   logits_to_keep=1, past_key_values=cache).logits
                    pos = pos + 1
            return (time.perf_counter() - t0) / steps * 1000.0, logits

        best = {"dynamic": float("inf"), "reserved": float("inf")}
        last = {}
        for rep in range(ARGS.reps):
            for kind in best:
                ms, last[kind] = decode(kind)
                best[kind] = min(best[kind], ms)
                repeats.append({"context": ctx, "rep": rep, "cache": kind, "ms_per_step": ms})
        same = bool(torch.equal(last["dynamic"], last["reserved"]))
        print(f"[context {ctx}] DynamicLayer {best['dynamic']:.1f} ms/step, ReservedLayer "
              f"{best['reserved']:.1f} ms/step, last logits identical={same}", flush=True)
        if not same:
            print("ERROR: the two caches gave different logits", file=sys.stderr)
            return 1
        per_ctx[ctx] = best
        rows.append(Row(f"context {ctx}: DynamicLayer / ReservedLayer [ms per step]", best["reserved"],
                        best["dynamic"], ratio=best["dynamic"] / best["reserved"], unit="ms"))
    benchlib.print_table(rows, f"kv_cache_decode: {ARGS.model}, {n} rows, {steps} decode steps, "
                               f"{ARGS.threads} thread(s), fp32 (ours = ReservedLayer ms/step)")
    benchlib.write_results(run, rows, repeats, {"best_ms_per_step": per_ctx})
    return 0


if __name__ == "__main__":
    sys.exit(main())
