"""Trajectory store write and read throughput, local disk vs a real S3 server (SeaweedFS).

    .venv/bin/python bench/store_throughput.py                    # 2,000 episodes x 4 turns
    .venv/bin/python bench/store_throughput.py --episodes 500 --backends local

The data: synthetic episodes shaped like BabyAI ones (``--turns`` turns of ~300-token, ~900
character observations and 8-token replies; random ids, so the token columns compress like
real ones do not: a pessimistic size). Generated before timing starts.

Measured per backend (local: a temp folder; s3: ``weed mini`` from tests/seaweed.py on
127.0.0.1, so the network is loopback and the server shares this machine's cores):

* write  — ``EpisodeWriter`` with the default ``store.chunk_episodes`` (64): staged shards per
  chunk, then one all-or-nothing commit (rename + manifest), both tables;
* read   — ``TrajectoryStore.read_arrow`` of both tables: manifest lookup, fetch, sha256 check;
* pandas — ``pd.read_parquet`` of both table folders, as users read them (no verification).

Rows are episodes + turns rows; MB are the Parquet bytes on storage (zstd), MiB/s of those.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd


def make_episodes(n: int, turns: int, seed: int = 0) -> list:
    from agentgym.types import Episode, Turn

    rng = random.Random(seed)
    words = ["red", "ball", "key", "door", "wall", "grey", "box", "step", "left", "right", "ahead"]
    out = []
    for i in range(n):
        ep = Episode(f"e{i}", f"g{i // 8}", "babyai", i % 40, 0, turns)
        ep.append([rng.randrange(50_000) for _ in range(120)], sampled=False)
        for t in range(turns):
            reply = [rng.randrange(50_000) for _ in range(8)]
            ep.append(reply, sampled=True, logprobs=[-rng.random() for _ in reply])
            ep.append([rng.randrange(50_000) for _ in range(300)], sampled=False)
            obs = " ".join(rng.choice(words) for _ in range(180))
            ep.turns.append(Turn(t, obs, "Action: move forward", "move forward", 0.0,
                                 t == turns - 1, False, False, len(reply), 2.0))
        ep.terminated = True
        out.append(ep)
    return out


def bench_backend(name: str, root: str, opts: dict, episodes: list, chunk: int) -> list[dict]:
    from agentgym.store import TrajectoryStore

    store = TrajectoryStore(root, f"bench-{name}", storage_options=opts)
    rows = len(episodes) + sum(e.num_turns for e in episodes)
    t0 = time.perf_counter()
    with store.episode_writer(stage=0, iteration=0, global_step=0, policy_version=0,
                              chunk_episodes=chunk) as w:
        for ep in episodes:
            w.add(ep)
        nbytes = w.staged_bytes
        w.commit()
    write_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    got = store.read_arrow("episodes").num_rows + store.read_arrow("turns").num_rows
    read_s = time.perf_counter() - t0
    assert got == rows, (got, rows)

    t0 = time.perf_counter()
    raw = sum(len(pd.read_parquet(store.path(t), storage_options=opts or None))
              for t in ("episodes", "turns"))
    pandas_s = time.perf_counter() - t0
    assert raw == rows, (raw, rows)
    return [{"backend": name, "op": op, "rows": rows, "mb": nbytes / 2**20, "s": s}
            for op, s in (("write", write_s), ("read", read_s), ("pandas", pandas_s))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=2000)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--backends", nargs="+", default=["local", "s3"])
    args = ap.parse_args()
    from agentgym.config import StoreConfig

    chunk = StoreConfig().chunk_episodes
    episodes = make_episodes(args.episodes, args.turns)
    results: list[dict] = []
    for backend in args.backends:
        if backend == "local":
            with tempfile.TemporaryDirectory(prefix="store-bench-") as d:
                results += bench_backend("local", d, {}, episodes, chunk)
        else:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from seaweed import seaweed

            with seaweed() as server:
                results += bench_backend("s3", f"s3://{server['bucket']}/bench",
                                         server["storage_options"], episodes, chunk)
    n_turns = sum(e.num_turns for e in episodes)
    print(f"{args.episodes} episodes + {n_turns} turn rows, chunks of {chunk} episodes\n")
    print(f"{'backend':<8} {'op':<7} {'rows':>7} {'MiB':>7} {'s':>7} {'rows/s':>9} {'MiB/s':>7}")
    for r in results:
        print(f"{r['backend']:<8} {r['op']:<7} {r['rows']:>7} {r['mb']:>7.1f} {r['s']:>7.2f} "
              f"{r['rows'] / r['s']:>9.0f} {r['mb'] / r['s']:>7.1f}")
    by = {(r["backend"], r["op"]): r for r in results}
    if ("local", "write") in by and ("s3", "write") in by:
        print("\ns3 / local time:", "  ".join(
            f"{op} x{by['s3', op]['s'] / by['local', op]['s']:.1f}" for op in ("write", "read", "pandas")))


if __name__ == "__main__":
    main()
