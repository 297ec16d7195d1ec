"""Trajectory store write and read throughput vs raw pyarrow, local disk and a real S3 server (SeaweedFS).

    nice -n 19 .venv/bin/python bench/store_throughput.py                 # 25,000 episodes x 4 turns = 100k turns
    nice -n 19 .venv/bin/python bench/store_throughput.py --episodes 2000 --backends local

Issue #10 item 5, target: ours >= 0.8 of raw pyarrow, write and read, on each backend.

The data: synthetic episodes shaped like BabyAI ones (``--turns`` turns of ~300-token, ~900
character observations and 8-token replies; random ids, so the token columns compress like
real ones do not: a pessimistic size). Generated before timing starts.

Measured per backend (local: a temp folder; s3: ``weed mini`` from tests/seaweed.py on
127.0.0.1, so the network is loopback and the server shares this machine's cores):

* write  — ``EpisodeWriter`` with the default ``store.chunk_episodes`` (64): staged shards per
  chunk, then one all-or-nothing commit (rename + manifest), both tables;
* read   — ``TrajectoryStore.read_arrow`` of both tables: manifest lookup, fetch, sha256 check;
* pandas — ``pd.read_parquet`` of both table folders, as users read them (no verification).

And the raw pyarrow baselines on the same rows and the same filesystem (``store.fs``):

* raw write — per chunk of episodes, the same columns built with ``pa.Table.from_pydict``
  (the store's physical schemas) and ``pq.write_table`` (zstd, as the store) to a file of
  the same backend: no validation, no staging, no manifest, no digest;
* raw read  — ``pq.read_table`` of the store's committed files (the same bytes), both tables,
  no manifest, no sha256, no stage/iteration columns.

Writes run once; reads ``--reps`` times each, ours and raw alternated, the best of each (every
read's seconds are in the record, ``bench/results/store_throughput-<tag>.json``).

Ratio = raw seconds / our seconds (ours / raw throughput).

Rows are episodes + turns rows; MB are the Parquet bytes on storage (zstd), MiB/s of those.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

import benchlib
import results_io
from benchlib import Row


def make_episodes(n: int, turns: int, seed: int = 0) -> list:
    from agentgym.types import Episode, Turn

    rng = np.random.default_rng(seed)
    words = np.array(["red", "ball", "key", "door", "wall", "grey", "box", "step", "left", "right", "ahead"])
    out = []
    for i in range(n):
        ep = Episode(f"e{i}", f"g{i // 8}", "babyai", i % 40, 0, turns)
        ids = rng.integers(0, 50_000, 120 + turns * 308).tolist()
        lps = (-rng.random(turns * 8)).tolist()
        ep.append(ids[:120], sampled=False)
        for t in range(turns):
            at = 120 + t * 308
            ep.append(ids[at:at + 8], sampled=True, logprobs=lps[t * 8:(t + 1) * 8])
            ep.append(ids[at + 8:at + 308], sampled=False)
            obs = " ".join(rng.choice(words, 180))
            ep.turns.append(Turn(t, obs, "Action: move forward", "move forward", 0.0,
                                 t == turns - 1, False, False, 8, 2.0))
        ep.terminated = True
        out.append(ep)
    return out


def bench_backend(name: str, root: str, opts: dict, episodes: list, chunk: int, reps: int = 3) -> list[dict]:
    from agentgym.store.trajectory_store import TrajectoryStore

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

    files = [store.abs_path(f) for t in ("episodes", "turns")  # the committed files, for the raw read
             for m in store.commits(t) for f in m.files]
    # raw pyarrow at its best: its own local filesystem on disk (through fsspec a local read is
    # several times slower), the store's fsspec filesystem for S3
    raw_fs = None if "://" not in store.root else store.fs
    reads: list[float] = []
    raw_reads: list[float] = []
    for _ in range(reps):  # ours and raw alternated, best of each: a load change hits both
        t0 = time.perf_counter()
        got = store.read_arrow("episodes").num_rows + store.read_arrow("turns").num_rows
        reads.append(time.perf_counter() - t0)
        assert got == rows, (got, rows)
        t0 = time.perf_counter()
        got = sum(pq.read_table(f, filesystem=raw_fs).num_rows for f in files)
        raw_reads.append(time.perf_counter() - t0)
        assert got == rows, (got, rows)
    read_s, raw_read_s = min(reads), min(raw_reads)

    t0 = time.perf_counter()
    raw = sum(len(pd.read_parquet(store.path(t), storage_options=opts or None))
              for t in ("episodes", "turns"))
    pandas_s = time.perf_counter() - t0
    assert raw == rows, (raw, rows)

    raw_dir = f"{store.root.rstrip('/')}/raw-{name}"
    t0 = time.perf_counter()
    raw_write_files = raw_write(store.fs, raw_dir, episodes, chunk, store.run_id)
    raw_write_s = time.perf_counter() - t0

    every = {"write": [write_s], "read": reads, "pandas": [pandas_s], "raw write": [raw_write_s],
             "raw read": raw_reads}
    return [{"backend": name, "op": op, "rows": rows, "mb": nbytes / 2**20, "s": s, "every_s": every[op]}
            for op, s in (("write", write_s), ("read", read_s), ("pandas", pandas_s),
                          ("raw write", raw_write_s), ("raw read", raw_read_s))] + [
        {"backend": name, "op": "raw files", "files": raw_write_files, "read_files": len(files)}]


def raw_write(fs, root: str, episodes: list, chunk: int, run_id: str) -> int:
    """The raw pyarrow write of ``episodes``: per chunk, both tables from Python lists with the
    store's physical schemas, ``pq.write_table`` (zstd) straight to ``root`` on ``fs``. The
    columns are the ones ``TrajectoryStore`` writes (``_tables``): when the schema gains one,
    add it here too (the check below names it)."""
    import datetime as dt

    from agentgym.store.schema import physical_schema

    fs.makedirs(root, exist_ok=True)  # (local: a plain folder path)
    now = dt.datetime.now(dt.timezone.utc)
    files = 0
    for c in range(0, len(episodes), chunk):
        eps = episodes[c:c + chunk]
        n = len(eps)
        ep_cols = {"run_id": [run_id] * n, "global_step": [0] * n,
                   "episode_id": [e.episode_id for e in eps], "group_id": [e.group_id for e in eps],
                   "env": [e.env for e in eps], "task_id": [e.task_id for e in eps],
                   "seed": [e.seed for e in eps], "horizon": [e.horizon for e in eps],
                   "num_turns": [e.num_turns for e in eps], "terminated": [e.terminated for e in eps],
                   "truncated": [e.truncated for e in eps], "reward": [e.reward for e in eps],
                   "success": [e.success for e in eps], "infra_error": [e.infra_error for e in eps],
                   "error": [e.error for e in eps], "policy_version": [0] * n, "created_at": [now] * n,
                   "input_ids": [e.input_ids for e in eps], "loss_mask": [e.loss_mask for e in eps],
                   "old_logprobs": [e.old_logprobs for e in eps],
                   "context_starts": [e.context_starts for e in eps],
                   "action_starts": [e.action_starts for e in eps],
                   "action_candidates": [e.action_candidates for e in eps]}
        tr = [(e, t) for e in eps for t in e.turns]
        tu_cols = {"run_id": [run_id] * len(tr), "episode_id": [e.episode_id for e, _ in tr],
                   "env": [e.env for e, _ in tr], "task_id": [e.task_id for e, _ in tr],
                   "turn": [t.turn for _, t in tr], "observation": [t.observation for _, t in tr],
                   "action_text": [t.action_text for _, t in tr],
                   "parsed_action": [t.parsed_action for _, t in tr], "reward": [t.reward for _, t in tr],
                   "terminated": [t.terminated for _, t in tr], "truncated": [t.truncated for _, t in tr],
                   "format_error": [t.format_error for _, t in tr], "gen_tokens": [t.gen_tokens for _, t in tr],
                   "env_latency_ms": [t.env_latency_ms for _, t in tr],
                   "invalid_action": [t.invalid_action for _, t in tr],
                   "state_key": [t.state_key for _, t in tr], "success": [e.success for e, _ in tr],
                   "horizon": [e.horizon for e, _ in tr]}
        for table, cols in (("episodes", ep_cols), ("turns", tu_cols)):
            schema = physical_schema(table)
            if set(cols) != set(schema.names):  # the schema gained (or lost) a column: say which
                raise KeyError(f"raw_write's {table} columns differ from the store's schema: missing "
                               f"{sorted(set(schema.names) - set(cols))}, extra {sorted(set(cols) - set(schema.names))}")
            data = pa.Table.from_pydict(cols, schema=schema)
            if "://" not in root:  # local disk: pyarrow's own filesystem
                pq.write_table(data, f"{root}/{table}-{c}.parquet", compression="zstd")
            else:
                with fs.open(f"{root}/{table}-{c}.parquet", "wb") as f:
                    pq.write_table(data, f, compression="zstd")
            files += 1
    return files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=25_000)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--backends", nargs="+", default=["local", "s3"])
    ap.add_argument("--reps", type=int, default=3, help="reads of each side, alternated; the best counts")
    ap.add_argument("--quick", action="store_true", help="200 episodes, local only (smoke)")
    results_io.add_tag_argument(ap)
    args = ap.parse_args()
    if args.quick:
        args.episodes, args.backends = 200, ["local"]
    run = benchlib.start("store_throughput", args)
    from agentgym.config import StoreConfig

    chunk = StoreConfig().chunk_episodes
    t0 = time.perf_counter()
    episodes = make_episodes(args.episodes, args.turns)
    print(f"made {args.episodes} episodes in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    results: list[dict] = []
    for backend in args.backends:
        if backend == "local":
            with tempfile.TemporaryDirectory(prefix="store-bench-") as d:
                results += bench_backend("local", d, {}, episodes, chunk, args.reps)
        else:
            seaweed = benchlib.load_tests_module("seaweed").seaweed

            with seaweed() as server:
                results += bench_backend("s3", f"s3://{server['bucket']}/bench",
                                         server["storage_options"], episodes, chunk, args.reps)
        print(f"[{backend}] done", file=sys.stderr, flush=True)
    n_turns = sum(e.num_turns for e in episodes)
    timed = [r for r in results if "s" in r]
    print(f"{args.episodes} episodes + {n_turns} turn rows, chunks of {chunk} episodes\n")
    print(f"{'backend':<8} {'op':<9} {'rows':>7} {'MiB':>7} {'s':>7} {'rows/s':>9} {'MiB/s':>7}")
    for r in timed:
        print(f"{r['backend']:<8} {r['op']:<9} {r['rows']:>7} {r['mb']:>7.1f} {r['s']:>7.2f} "
              f"{r['rows'] / r['s']:>9.0f} {r['mb'] / r['s']:>7.1f}")
    by = {(r["backend"], r["op"]): r for r in timed}
    if ("local", "write") in by and ("s3", "write") in by:
        print("\ns3 / local time:", "  ".join(
            f"{op} x{by['s3', op]['s'] / by['local', op]['s']:.1f}" for op in ("write", "read", "pandas")))
    rows = []
    for backend in args.backends:
        for op in ("write", "read"):
            ours, raw = by[backend, op], by[backend, f"raw {op}"]
            rows.append(Row(f"{backend} {op}", ours["rows"] / ours["s"], raw["rows"] / raw["s"],
                            target=(">=", 0.8), unit="rows/s"))
    benchlib.print_table(rows, f"ours vs raw pyarrow ({n_turns} turns)")
    benchlib.write_results(run, rows, results, {"chunk_episodes": chunk, "turn_rows": n_turns})


if __name__ == "__main__":
    main()
