"""Spread of the learning tests' gain over seeds: where their margins come from.

The learning tests in tests/agentgym/test_training.py (`test_learning_sanity_reward_goes_up[*]`,
`test_lora_learns_*`) run a fixed number of iterations from seed 0 and assert that the mean
reward of the last three iterations beats the first three by a margin. Another machine of the
same kind draws other samples from the same seed (its CPU kernels round differently), so a
margin must hold for the seed-to-seed spread, not for the one trajectory seen where the test was
written. This script runs those tests once per seed (AGENTGYM_LEARN_SEED) and prints, per case,
the gain (last - first) of every seed, its mean, standard deviation and minimum.

    .venv/bin/python bench/learning_test_spread.py --seeds 12 [-k lora]

Every seed's first and last reward per case go into ``bench/results/learning_test_spread-<tag>.json``.
Run it alone on the machine (one pytest process at a time, one torch thread, as the suite runs).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^(?P<case>[\w-]+): reward (?P<first>[\d.]+) -> (?P<last>[\d.]+)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=12)
    ap.add_argument("-k", default="sanity_reward_goes_up or lora_learns", help="pytest -k expression")
    ap.add_argument("--tag", default="", help="the record's name: bench/results/learning_test_spread-<tag>.json "
                    "(default: the UTC time)")
    args = ap.parse_args()
    import results_io  # bench/, the script's folder, is on sys.path

    run = results_io.Run("learning_test_spread", args)
    repeats: list[dict] = []
    gains: dict[str, list[float]] = defaultdict(list)
    t0 = time.perf_counter()
    for seed in range(args.seeds):
        env = {**os.environ, "AGENTGYM_LEARN_SEED": str(seed)}
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                              "tests/agentgym/test_training.py", "-k", args.k],
                             cwd=ROOT, env=env, capture_output=True, text=True)
        for line in out.stdout.splitlines():
            m = LINE.match(line.lstrip(".FEs"))  # pytest -q -s puts the progress marks before the line
            if m:
                gains[m["case"]].append(float(m["last"]) - float(m["first"]))
                repeats.append({"seed": seed, "case": m["case"], "first": float(m["first"]),
                                "last": float(m["last"]), "gain": float(m["last"]) - float(m["first"])})
        print(f"seed {seed}: {out.stdout.strip().splitlines()[-1]} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\n{'case':<14} {'n':>3} {'mean':>6} {'sd':>6} {'min':>6} {'mean-3sd':>8}  gains")
    stats = {}
    for case, g in sorted(gains.items()):
        sd = statistics.stdev(g) if len(g) > 1 else 0.0
        mean = statistics.fmean(g)
        stats[case] = {"n": len(g), "mean": mean, "sd": sd, "min": min(g)}
        print(f"{case:<14} {len(g):>3} {mean:6.3f} {sd:6.3f} {min(g):6.3f} {mean - 3 * sd:8.3f}  "
              f"{[round(x, 3) for x in g]}")
    print(f"results: {run.write(repeats, stats)}")


if __name__ == "__main__":
    main()
