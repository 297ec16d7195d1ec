"""Peak RSS of one iteration's rollout + store write, 200 vs 2,000 short episodes, side by side.

    .venv/bin/python bench/rollout_memory.py                 # 200 and 2,000 episodes, both paths
    .venv/bin/python bench/rollout_memory.py --sizes 200 2000 --horizon 4

What runs: the real multi-turn loop (``agentgym.rollout.loop``) against the real BabyAI adapter
(minigrid), with the tiny model's tokenizer and chat template, and the real trajectory store on
local disk. Only the policy is scripted (``ScriptedEngine``: a fixed cycle of BabyAI moves as
token ids with made-up log-probs), so the numbers measure the rollout and the store, not a
model's weights or KV cache (a real engine adds its own, bounded by the live batch too).

Two paths, each size in a fresh child process (``ru_maxrss`` is per process):

* ``stream``: what ``PolicySession.collect`` does now: ``iter_episodes`` with the default
  ``rollout.max_live_episodes`` (256) and an ``EpisodeWriter`` with the default
  ``store.chunk_episodes`` (64), committed once at the end;
* ``hold``: what it did before: ``run_episodes`` with every episode live at once, then one
  ``write_episodes`` of the whole list.

Reported: RSS before the rollout (imports, tokenizer, one BabyAI level warmed up), the peak
during it, the rollout's own share (peak - before) and the ratios 2,000 / 200; every child's
figures go into ``bench/results/rollout_memory-<tag>.json`` (``results_io``).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ACTIONS = ["turn left", "move forward", "turn right", "move forward", "pickup"]


def _no_cache_engine() -> type:
    """The tests' scripted-engine base (tests/scripted_engine.py), loaded by path: putting tests/
    on sys.path would let tests/env_adapters shadow the env_adapters package."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tests" / "scripted_engine.py"
    spec = importlib.util.spec_from_file_location("scripted_engine", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.NoCacheEngine


class ScriptedEngine(_no_cache_engine()):
    """An ``InferenceEngine`` that replies with BabyAI moves in a fixed cycle (token ids of
    ``Action: <move>`` + end of turn), log-prob -0.5 per token; no model, no cache."""

    def __init__(self, tokenizer):
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.replies = [tokenizer(f"Action: {a}", add_special_tokens=False)["input_ids"] + [end]
                        for a in ACTIONS]
        self.generated_tokens = 0
        self.calls = 0

    def generate(self, prompts, params, cache_keys=None):
        from agentgym.rollout.engines.base import Sample

        self.calls += 1
        out = []
        for i, _ in enumerate(prompts):
            ids = self.replies[(i + self.calls) % len(self.replies)]
            self.generated_tokens += len(ids)
            out.append(Sample(list(ids), [-0.5] * len(ids), "stop"))
        return out


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(n: int, mode: str, horizon: int) -> dict:
    """One rollout of ``n`` episodes in this process; returns its memory and timing."""
    from transformers import AutoTokenizer

    from agentgym.chat import ChatFormatter
    from agentgym.config import RolloutConfig, StoreConfig
    from agentgym.models.folders import tiny_model_path
    from agentgym.rollout.loop import EpisodeSpec, RolloutSettings, iter_episodes, run_episodes
    from agentgym.store.trajectory_store import TrajectoryStore
    from env_adapters import make_env

    tok = AutoTokenizer.from_pretrained(tiny_model_path())
    fmt, engine = ChatFormatter(tok), ScriptedEngine(tok)
    warm = make_env("babyai")
    warm.reset(0, 0)
    warm.close()
    tasks, group = 40, 5  # n / group groups over 40 BabyAI tasks (levels and seeds vary)
    specs = [EpisodeSpec("babyai", g % tasks, g // tasks, f"g{g}", f"g{g}-e{i}")
             for g in range(n // group) for i in range(group)]
    with tempfile.TemporaryDirectory(prefix="rollout-mem-") as root:
        store = TrajectoryStore(root, "bench")
        before = _rss_mb()
        t0 = time.perf_counter()
        if mode == "stream":
            settings = RolloutSettings(horizon=horizon, max_new_tokens=16, seed=0,
                                       max_live=RolloutConfig().max_live_episodes)
            with store.episode_writer(stage=0, iteration=0, global_step=0, policy_version=0,
                                      chunk_episodes=StoreConfig().chunk_episodes) as w:
                for ep in iter_episodes(engine, fmt, specs, settings, make_env):
                    w.add(ep)
                m = w.commit()
        else:
            settings = RolloutSettings(horizon=horizon, max_new_tokens=16, seed=0)
            eps = run_episodes(engine, fmt, specs, settings, make_env)
            m = store.write_episodes(eps, stage=0, iteration=0, global_step=0, policy_version=0)
        seconds = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        turns = m.extra["turns"]["rows"]
        tokens = int(store.read_arrow("episodes", columns=["num_turns", "input_ids"])
                     .column("input_ids").combine_chunks().value_lengths().to_numpy().sum())
    return {"n": n, "mode": mode, "rss_before_mb": before, "peak_mb": peak, "seconds": seconds,
            "rows": m.rows, "turns": turns, "tokens": tokens, "files": len(m.files)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[200, 2000],
                    help="episode counts; ratios are to the first")
    ap.add_argument("--horizon", type=int, default=4)
    ap.add_argument("--modes", nargs="+", default=["stream", "hold"])
    ap.add_argument("--child", nargs=2, metavar=("N", "MODE"), help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="", help="the record's name: bench/results/rollout_memory-<tag>.json "
                    "(default: the UTC time)")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(int(args.child[0]), args.child[1], args.horizon)))
        return
    import results_io  # bench/, the script's folder, is on sys.path

    run = results_io.Run("rollout_memory", args)
    res: dict[tuple[str, int], dict] = {}
    for mode in args.modes:
        for n in args.sizes:
            out = subprocess.run([sys.executable, __file__, "--child", str(n), mode,
                                  "--horizon", str(args.horizon)],
                                 check=True, capture_output=True, text=True)
            res[mode, n] = json.loads(out.stdout.strip().splitlines()[-1])
    small = args.sizes[0]
    print(f"BabyAI, horizon {args.horizon}, scripted policy, local store; RSS in MiB\n")
    print(f"{'path':<7} {'episodes':>8} {'turns':>7} {'tokens':>9} {'files':>5} {'s':>6} "
          f"{'RSS before':>10} {'peak':>7} {'rollout (peak-before)':>22}")
    for mode in args.modes:
        for n in args.sizes:
            r = res[mode, n]
            print(f"{mode:<7} {n:>8} {r['turns']:>7} {r['tokens']:>9} {r['files']:>5} "
                  f"{r['seconds']:>6.1f} {r['rss_before_mb']:>10.0f} {r['peak_mb']:>7.0f} "
                  f"{r['peak_mb'] - r['rss_before_mb']:>22.0f}")
    ratios = []
    for big in args.sizes[1:]:
        print(f"\nratios {big} / {small} episodes:")
        for mode in args.modes:
            a, b = res[mode, small], res[mode, big]
            own_a, own_b = a["peak_mb"] - a["rss_before_mb"], b["peak_mb"] - b["rss_before_mb"]
            print(f"  {mode:<7} peak RSS x{b['peak_mb'] / a['peak_mb']:.2f}   "
                  f"rollout's own x{own_b / own_a:.2f}   (episodes x{big / small:.0f})")
            ratios.append({"mode": mode, "episodes": [small, big], "peak_ratio": b["peak_mb"] / a["peak_mb"],
                           "own_ratio": own_b / own_a})
    out = run.write(list(res.values()), {"ratios": ratios})
    print(f"results: {out}")


if __name__ == "__main__":
    main()
