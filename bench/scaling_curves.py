"""Scaling curves: rollout and update time against batch size and horizon (the cost of long horizons).

    nice -n 19 .venv/bin/python bench/scaling_curves.py                       # tiny model, ~4 min
    nice -n 19 .venv/bin/python bench/scaling_curves.py --batches 4 16 --horizons 3 5 10 20 40

Issue #10 item 7. For each (batch size B, horizon H): one rollout of B episodes through the real
loop (``agentgym.rollout.loop.run_episodes``, HF engine, KV cache kept across turns) on an environment
that never ends early (bench/rollout_efficiency.py's ``zero`` env: the same ``--obs-words``
observation every turn), so every episode runs exactly H turns, then one GRPO update
(``PolicyTrainer.train_on_batch``: ppo_epochs 1, one mini-batch, micro-batch 4, fp32) on those
episodes (advantages +-1). ScalingInter-RL trains at short horizons first: the curves show what
each turn of horizon costs. Writes ``bench/results/scaling_curves-<tag>.json`` (every point; committed)
and ``.png`` beside it (git-ignored). The committed plot, bench/scaling_curves.png, is drawn from a
committed record: ``--plot-from bench/results/scaling_curves-<tag>.json --out bench/scaling_curves.png``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--horizons", type=int, nargs="+", default=[3, 5, 10, 20])
    ap.add_argument("--new-tokens", type=int, default=12, help="max_new_tokens per reply (quickstart: 12)")
    ap.add_argument("--obs-words", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: see bench/README.md)")
    ap.add_argument("--quick", action="store_true", help="batch 2, horizons 1 2 (smoke)")
    ap.add_argument("--plot-from", default=None, metavar="RECORD",
                    help="measure nothing: draw the plot of this committed record's points (to --out)")
    ap.add_argument("--out", default="bench/scaling_curves.png", help="the plot --plot-from draws")
    ap.add_argument("--tag", default="", help="the record's name: bench/results/scaling_curves-<tag>.json "
                    "(default: the UTC time; --quick: smoke)")
    args = ap.parse_args()
    if args.quick:
        args.batches, args.horizons = [2], [1, 2]
    return args


ARGS = _parse()
os.environ.setdefault("OMP_NUM_THREADS", str(ARGS.threads))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main() -> int:
    if ARGS.plot_from:  # the committed plot, from the committed record's points
        import json

        with open(ARGS.plot_from) as f:
            record = json.load(f)
        _plot(record["repeats"], ARGS.out)
        print(f"plot: {ARGS.out} (from {ARGS.plot_from}, {record['date']})")
        return 0
    import torch

    import benchlib
    from agentgym.chat import ChatFormatter
    from agentgym.config import AlgorithmConfig, TrainerConfig
    from agentgym.rollout.engines import create_engine
    from agentgym.models.folders import tiny_model_path
    from agentgym.rollout.loop import EpisodeSpec, RolloutSettings, run_episodes
    from agentgym.training.batch import TrainBatch
    from agentgym.training.policy_trainer import PolicyTrainer
    from benchlib import Row

    torch.set_num_threads(ARGS.threads)
    # the zero env of rollout_efficiency.py (importing it would parse this script's arguments)
    from env_adapters.base import StepResult, TextEnv

    obs = "You see " + " ".join(["a red ball", "a grey wall", "an open door"][i % 3]
                                for i in range(ARGS.obs_words // 3)) + "."

    class ZeroEnv(TextEnv):
        name = "zero"

        def reset(self, task_id, seed=0):
            return obs, {}

        def step(self, action_text):
            return StepResult(obs, 0.0, False)

    run = benchlib.start("scaling_curves", ARGS)
    path = tiny_model_path()
    engine, tok = create_engine("hf", path, "float32")
    fmt = ChatFormatter(tok)
    trainer = PolicyTrainer(path, tok, TrainerConfig(learning_rate=1e-6, bf16=False, micro_batch_size=4),
                            AlgorithmConfig(estimator="grpo", ppo_epochs=1, mini_batches=1), seed=0)
    pad = tok.pad_token_id or 0
    points = []
    run_episodes(engine, fmt, [EpisodeSpec("zero", 0, 0, "w", "w0")], RolloutSettings(horizon=2, max_new_tokens=4),
                 lambda name, **kw: ZeroEnv())  # warm-up
    for b in ARGS.batches:
        for h in ARGS.horizons:
            specs = [EpisodeSpec("zero", i, 0, f"g{i // 2}", f"b{b}-h{h}-e{i}") for i in range(b)]
            settings = RolloutSettings(horizon=h, max_new_tokens=ARGS.new_tokens, max_context_tokens=32768, seed=h)
            t0 = time.perf_counter()
            eps = run_episodes(engine, fmt, specs, settings, lambda name, **kw: ZeroEnv())
            roll_s = time.perf_counter() - t0
            rows = [{"input_ids": e.input_ids, "loss_mask": e.loss_mask, "old_logprobs": e.old_logprobs,
                     "advantages": [(1.0 if i % 2 else -1.0) * m for m in e.loss_mask]} for i, e in enumerate(eps)]
            batch = TrainBatch.from_rows(rows, pad)
            t0 = time.perf_counter()
            trainer.train_on_batch(batch, seed=0)
            upd_s = time.perf_counter() - t0
            tokens = sum(len(e.input_ids) for e in eps)
            points.append({"batch": b, "horizon": h, "rollout_s": roll_s, "update_s": upd_s, "tokens": tokens,
                           "generated": sum(sum(e.loss_mask) for e in eps), "loadavg": os.getloadavg()})
            print(f"[B={b} H={h}] rollout {roll_s:.2f}s update {upd_s:.2f}s tokens {tokens}", file=sys.stderr, flush=True)
    trainer.close()
    engine.close()

    print(f"\nscaling_curves: tiny model, {ARGS.new_tokens} new tokens/reply, {ARGS.threads} thread(s)")
    print(f"{'B':>4} {'H':>4} {'tokens':>8} {'rollout s':>10} {'update s':>9} {'rollout s/turn':>15}")
    for p in points:
        print(f"{p['batch']:>4} {p['horizon']:>4} {p['tokens']:>8} {p['rollout_s']:>10.2f} {p['update_s']:>9.2f} "
              f"{p['rollout_s'] / p['horizon']:>15.3f}")
    rows = []
    for b in ARGS.batches:  # the longest horizon vs the shortest: cost ratio vs turns ratio
        pts = sorted((p for p in points if p["batch"] == b), key=lambda p: p["horizon"])
        if len(pts) > 1:
            lo, hi = pts[0], pts[-1]
            rows.append(Row(f"B={b} rollout H{hi['horizon']}/H{lo['horizon']}", hi["rollout_s"], lo["rollout_s"],
                            unit=f"s; turns x{hi['horizon'] / lo['horizon']:g}"))
            rows.append(Row(f"B={b} update H{hi['horizon']}/H{lo['horizon']}", hi["update_s"], lo["update_s"],
                            unit=f"s; turns x{hi['horizon'] / lo['horizon']:g}"))
    benchlib.print_table(rows, "long vs short horizon (ratio = time ratio; no target: a figure)")
    out = benchlib.write_results(run, rows, points)
    png = out.with_suffix(".png")
    _plot(points, png)
    print(f"plot: {png}")
    return 0


def _plot(points: list[dict], png) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "rollout_s", "rollout"), (axes[1], "update_s", "update (one GRPO step)")):
        for b in sorted({p["batch"] for p in points}):
            pts = sorted((p for p in points if p["batch"] == b), key=lambda p: p["horizon"])
            ax.plot([p["horizon"] for p in pts], [p[key] for p in pts], marker="o", label=f"batch {b}")
        ax.set_xlabel("horizon (turns)")
        ax.set_ylabel("seconds")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Tiny model, CPU: time against horizon and batch size")
    fig.tight_layout()
    fig.savefig(png, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
