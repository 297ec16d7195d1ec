"""Rollouts over 1, 2 and 4 rollout workers (Ray actors) for environments with 0, 100 and 300 ms per step.

    .venv/bin/python bench/rollout_scaling.py                         # tiny model, 3 x 3 cells + in-process, ~1.5 min
    .venv/bin/python bench/rollout_scaling.py --model smollm2 --delays-ms 300 --warmup 1 --reps 2   # one cell per N, ~3 min
    .venv/bin/python bench/rollout_scaling.py --model smollm2 --sync-only --sync-reps 6 \
        --out bench/results/rollout_scaling-smollm2-sync.json        # SmolLM2's weight sync alone, ~1.5 min

The real iteration path: ``PolicySession.collect`` (``agentgym/pipeline.py``) over a
``RolloutPool`` of ``--workers`` actors on an embedded Ray cluster (``ray.address: local``,
loopback), each actor asking for ``ray.cpus_per_worker`` 1 with one torch thread; the driver
adopts the staged shards and commits the iteration once, as in training. One workload for
every cell: ``--tasks`` keyword tasks x ``--group-size`` episodes (``mode: starts_with``, a
wrong word gets a retry prompt, so an episode of the random tiny model plays all ``--horizon``
turns), ``--max-new-tokens`` per reply, ``sampling_seeds: per_episode`` and one global step
for every iteration, so every rep of every cell plays the very same episodes token for token
(the JSON records each cell's generated tokens and env steps, which agree). Every environment
step first sleeps ``step_delay_s`` (a remote environment server's round trip: the worker's
threads wait, no CPU is spent).

Per cell (workers N x delay L), ``--warmup`` iterations then ``--reps`` measured ones, medians:

* episodes/s = episodes / ``rollout_seconds`` (dispatch to the last worker's return and the
  shards' adoption; the manifest commit after it is in the JSON as ``commit_s``);
* speed-up = episodes/s over the 1-worker cell's at the same delay; ``vs inproc`` = over the
  in-process baseline's (``ray.address: null``, ``rollout.workers: 1``: the engine in the
  driver, no Ray at all), the same episodes;
* busy share = sum over workers of their generate seconds / (N x rollout wall seconds): the
  share of the workers' time spent in ``engine.generate`` (the in-process baseline: its
  generate seconds / its wall);
* Ray overhead per iteration = rollout wall seconds - the slowest worker's own ``seconds``
  inside its actor call (``RolloutWorker.collect``): what the driver pays for dispatching the
  shares, serialising specs and results, staging handoff and gathering;
* weight sync = ``RolloutPool.sync`` of the full fp32 weights (``name -> tensor`` of the
  model's parameters, as the trainer hands them over) from the driver through Ray's object
  store to every worker: ``ray.put``, each worker's fetch and ``engine.update_weights``; also
  the put alone and the slowest worker's load. Measured after the cells, ``--sync-reps`` times.

On the 2-core machine this was written on, N workers with one CPU each are N processes on 2
cores (the embedded cluster is told it has ``max(--workers)`` CPUs so that 4 workers place):
1 worker uses one core, 2 workers can use both, 4 workers share 2 cores, so generation cannot
scale past 2 and the rest of any speed-up comes from one worker generating while another's
episodes wait on their environment. Within one worker the episodes already wait on their
environments concurrently (``rollout.env_workers`` threads), so more workers do not shorten
the waits themselves.

The run waits (``--max-load``, ``--load-waits``) for the 1-minute load average to drop below
1.5 before it starts; the load before and after each cell is in the JSON, and so is the CPU
other jobs used during its measured iterations (``foreign_cores``: the machine's busy CPU
seconds minus this process tree's, the Ray node included, per wall second); a cell above
``--foreign-max`` cores is marked ``*`` in the table. Results go to
``bench/results/rollout_scaling.json`` (``-smollm2`` for that model; ``results_io``: config, commit,
machine, load, every rep of every cell and every sync as ``repeats``), which is committed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchlib
import results_io

benchlib.set_preimport_env(1)

def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--delays-ms", type=float, nargs="+", default=[0.0, 100.0, 300.0],
                    help="environment step delays (ms)")
    ap.add_argument("--tasks", type=int, default=8, help="tasks per iteration (GRPO groups)")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--horizon", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured iterations per cell")
    ap.add_argument("--reps", type=int, default=5, help="measured iterations per cell (median)")
    ap.add_argument("--sync-reps", type=int, default=3, help="weight syncs per worker count (median)")
    ap.add_argument("--sync-only", action="store_true", help="no rollout cells: start the pools and sync")
    ap.add_argument("--no-baseline", action="store_true", help="skip the in-process (no Ray) baseline")
    ap.add_argument("--max-load", type=float, default=1.5,
                    help="wait while the 1-minute load average is above this before starting")
    ap.add_argument("--load-waits", type=int, default=5, help="waits of 60 s at most for --max-load")
    ap.add_argument("--foreign-max", type=float, default=0.25,
                    help="a cell during which other processes kept more cores than this busy on average "
                         "is marked '*' (beside other jobs)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/rollout_scaling[-TAG].json)")
    ap.add_argument("--tag", default="", help="the record's name: bench/results/rollout_scaling-<tag>.json "
                    "(default: none for the tiny model, the model's name otherwise)")
    return ap.parse_args()


def _config(args: argparse.Namespace, store: Path, workers: int | None, delay_ms: float):
    """The fixed workload; ``workers`` None: the in-process baseline (no Ray)."""
    from agentgym.config import parse_config

    env = {"name": "keyword", "tasks": list(range(args.tasks)),
           "kwargs": {"target": "yes", "mode": "starts_with", "step_delay_s": delay_ms / 1000.0}}
    ray = {"address": None, "cpus_per_worker": 1, "num_cpus": max(args.workers)}
    if workers is not None:
        ray["address"] = "local"
    return parse_config({
        "seed": 0,
        "model": {"name_or_path": args.model, "dtype": "float32"},
        "envs": [env],
        "store": {"root": str(store)},
        "ray": ray,
        "rollout": {"workers": workers or 1, "tasks_per_iteration": args.tasks, "group_size": args.group_size,
                    "max_new_tokens": args.max_new_tokens, "sampling_seeds": "per_episode",
                    "temperature": 1.0},
        "schedule": {"stages": [{"horizon": args.horizon, "iterations": 1}]},
    })


def _busy_cpu_s() -> tuple[float, float, float]:
    """(wall, CPU seconds the whole machine spent busy, CPU seconds of this process and its
    descendants: the Ray node's GCS, raylet and actors): their difference is other jobs' CPU."""
    import psutil

    t = psutil.cpu_times()
    busy = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    mine = 0.0
    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        try:
            c = p.cpu_times()
            mine += c.user + c.system
        except psutil.Error:
            pass
    return time.perf_counter(), busy, mine


def _foreign_cores(start: tuple[float, float, float]) -> float:
    """Cores other jobs kept busy on average since ``start`` (``_busy_cpu_s``)."""
    end = _busy_cpu_s()
    return max(0.0, (end[1] - start[1]) - (end[2] - start[2])) / (end[0] - start[0])


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Cells:
    """One session (one pool) per worker count; its cells swap the environment's delay."""

    def __init__(self, args: argparse.Namespace, store: Path):
        self.args, self.store = args, store
        self.iteration = 0  # every collect commits a new iteration (same global step: same episodes)

    def open(self, workers: int | None) -> tuple[Any, dict[str, float]]:
        from agentgym.pipeline import PolicySession

        t0 = time.perf_counter()
        session = PolicySession(_config(self.args, self.store, workers, 0.0), f"scaling-{workers or 'inproc'}")
        start = {"session_start_s": time.perf_counter() - t0}
        if session.pool is not None:
            start["pool_start_s"] = session.pool.timings["start_s"]
            session._bench_results = []  # type: ignore[attr-defined]
            orig = session.pool.collect

            def collect(*a: Any, **kw: Any) -> list[dict[str, Any]]:  # the workers' own results
                res = orig(*a, **kw)
                session._bench_results.append(res)  # type: ignore[attr-defined]
                return res

            session.pool.collect = collect  # type: ignore[method-assign]
        return session, start

    def iterate(self, session: Any, workers: int | None, delay_ms: float) -> dict[str, Any]:
        from agentgym.pipeline import IterationRef

        session.cfg = _config(self.args, self.store, workers, delay_ms)  # the delay travels in the specs
        self.iteration += 1
        ref = IterationRef(0, self.iteration, 0)
        t0 = time.perf_counter()
        out = session.collect(ref, horizon=self.args.horizon)
        wall = time.perf_counter() - t0
        turns = session.store.read_arrow("episodes", stage=0, iteration=self.iteration,
                                         columns=["num_turns"]).column("num_turns").to_pylist()
        steps = int(sum(turns))
        rec = {"episodes": int(out["rows"]), "env_steps": steps, "generated_tokens": out["generated_tokens"],
               "rollout_s": out["rollout_seconds"], "collect_s": wall,
               "commit_s": out["time/rollout_store_commit_s"]}
        if workers is None:
            rec.update(generate_s=[out["time/generate_s"]], worker_s=[out["rollout_seconds"]], overhead_s=0.0,
                       busy=out["time/generate_s"] / out["rollout_seconds"])
        else:
            res = session._bench_results.pop()
            gen = [r["generate_s"] for r in res]
            secs = [r["seconds"] for r in res]
            rec.update(generate_s=gen, worker_s=secs, overhead_s=out["rollout_seconds"] - max(secs),
                       busy=sum(gen) / (workers * out["rollout_seconds"]), shares=len(res))
        return rec

    def cell(self, session: Any, workers: int | None, delay_ms: float) -> dict[str, Any]:
        load0 = os.getloadavg()
        for _ in range(self.args.warmup):
            self.iterate(session, workers, delay_ms)
        cpu0 = _busy_cpu_s()
        reps = [self.iterate(session, workers, delay_ms) for _ in range(self.args.reps)]
        foreign = _foreign_cores(cpu0)
        eps = reps[0]["episodes"]
        med = {k: _median([r[k] for r in reps]) for k in ("rollout_s", "collect_s", "commit_s", "busy", "overhead_s")}
        cell = {"workers": workers or 0, "inproc": workers is None, "delay_ms": delay_ms, "episodes": eps,
                "eps_per_s": eps / med["rollout_s"], **med, "reps": reps,
                "loadavg_before": load0, "loadavg_after": os.getloadavg(), "foreign_cores": foreign,
                "beside_other_jobs": foreign > self.args.foreign_max}
        tag = f"{workers} workers" if workers else "in-process"
        print(f"[{tag}, {delay_ms:g} ms] {cell['eps_per_s']:.2f} eps/s, rollout {med['rollout_s']:.2f} s, busy "
              f"{med['busy']:.2f}, overhead {med['overhead_s']:.3f} s, env steps {reps[0]['env_steps']}, "
              f"tokens {reps[0]['generated_tokens']:.0f}, load {load0[0]:.2f}->{cell['loadavg_after'][0]:.2f}, "
              f"other jobs {foreign:.2f} cores",
              file=sys.stderr, flush=True)
        return cell


def _weights(path: Path) -> dict[str, Any]:
    """The model's parameters in fp32 under their names, as a trainer hands them to ``sync``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _sync(session: Any, weights: dict[str, Any], reps: int) -> dict[str, Any]:
    import ray

    pool = session.pool
    runs = []
    cpu0 = _busy_cpu_s()
    for _ in range(reps):
        t0 = time.perf_counter()
        ref = ray.put(weights)
        put_s = time.perf_counter() - t0
        del ref
        got = pool.sync(weights, session.engine_version)  # put + every worker's fetch and load
        runs.append({"sync_s": got["time/weight_sync_s"], "load_max_s": got["time/weight_load_max_s"],
                     "put_s": put_s})
    return {k: _median([r[k] for r in runs]) for k in runs[0]} | {
        "sync_min_s": min(r["sync_s"] for r in runs), "sync_max_s": max(r["sync_s"] for r in runs), "runs": runs,
        "foreign_cores": _foreign_cores(cpu0)}


def _wait_for_load(args: argparse.Namespace) -> dict[str, Any]:
    seen = []
    for i in range(args.load_waits + 1):
        la = os.getloadavg()
        seen.append(la)
        if la[0] <= args.max_load:
            return {"quiet": True, "seen": seen}
        if i < args.load_waits:
            print(f"load average {la[0]:.2f} > {args.max_load}: waiting 60 s ({i + 1}/{args.load_waits})",
                  file=sys.stderr, flush=True)
            time.sleep(60)
    print(f"load average still {seen[-1][0]:.2f}: running anyway (marked in the JSON)", file=sys.stderr, flush=True)
    return {"quiet": False, "seen": seen}


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None or v != v else format(v, spec)


def main() -> int:
    args = _parse()
    import torch

    torch.set_num_threads(1)
    from agentgym.models.folders import resolve_model

    model_path = resolve_model(args.model)  # built / prepared before any timing
    load_gate = _wait_for_load(args)
    run = results_io.Run("rollout_scaling", args)
    load_before = run.load_start
    t_all = time.perf_counter()
    cells: list[dict[str, Any]] = []
    syncs: dict[int, dict[str, Any]] = {}
    starts: dict[str, dict[str, float]] = {}
    weights = _weights(model_path)
    weights_mb = sum(t.numel() * t.element_size() for t in weights.values()) / 2**20
    with tempfile.TemporaryDirectory(prefix="agentgym-rollout-scaling-") as tmp:
        runner = Cells(args, Path(tmp) / "store")
        if not args.no_baseline and not args.sync_only:
            session, starts["inproc"] = runner.open(None)
            try:
                cells += [runner.cell(session, None, d) for d in args.delays_ms]
            finally:
                session.close()
        for n in args.workers:
            session, starts[str(n)] = runner.open(n)
            try:
                if not args.sync_only:
                    cells += [runner.cell(session, n, d) for d in args.delays_ms]
                syncs[n] = _sync(session, weights, args.sync_reps)
                print(f"[{n} workers] sync {syncs[n]['sync_s']:.3f} s (put {syncs[n]['put_s']:.3f} s, slowest load "
                      f"{syncs[n]['load_max_s']:.3f} s) of {weights_mb:.1f} MiB; pool start "
                      f"{starts[str(n)]['pool_start_s']:.1f} s; other jobs {syncs[n]['foreign_cores']:.2f} cores",
                      file=sys.stderr, flush=True)
            finally:
                session.close()
    import ray

    ray.shutdown()
    total_s = time.perf_counter() - t_all

    # the table: workers x delay
    by = {(c["workers"], c["delay_ms"]): c for c in cells}
    for c in cells:
        one, inproc = by.get((1, c["delay_ms"])), by.get((0, c["delay_ms"]))
        c["speedup_vs_1_worker"] = c["eps_per_s"] / one["eps_per_s"] if one and not c["inproc"] else None
        c["speedup_vs_inproc"] = c["eps_per_s"] / inproc["eps_per_s"] if inproc else None
    header = ("workers", "env ms/step", "eps/s", "x 1 worker", "x inproc", "busy share", "sync s", "overhead s")
    lines = [header]
    for d in args.delays_ms:
        for n in ([0] if 0 in {k[0] for k in by} else []) + list(args.workers):
            c = by.get((n, d))
            if c is None:
                continue
            lines.append(((str(n) if n else "inproc") + (" *" if c["beside_other_jobs"] else ""), f"{d:g}",
                          _fmt(c["eps_per_s"], ".2f"),
                          _fmt(c["speedup_vs_1_worker"], ".2f"), _fmt(c["speedup_vs_inproc"], ".2f"),
                          _fmt(c["busy"], ".2f"), _fmt(syncs.get(n, {}).get("sync_s") if n else None, ".3f"),
                          _fmt(c["overhead_s"] if n else None, ".3f")))
    cores = os.cpu_count()
    if cells:
        print(f"\nrollout_scaling: {args.model}, {args.tasks} tasks x {args.group_size} episodes, horizon "
              f"{args.horizon}, {args.max_new_tokens} new tokens, median of {args.reps} (after {args.warmup} "
              f"warm-up); {cores} cores, 1 torch thread and 1 Ray CPU per worker")
        widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
        for j, r in enumerate(lines):
            print(" | ".join(x.rjust(w) for x, w in zip(r, widths)))
            if j == 0:
                print("-+-".join("-" * w for w in widths))
    print(f"weight sync of {weights_mb:.1f} MiB fp32 ({args.model}) through the object store, median of "
          f"{args.sync_reps}: " + ", ".join(f"{n} workers {s['sync_s']:.3f} s [{s['sync_min_s']:.3f}-{s['sync_max_s']:.3f}] "
                                            f"(put {s['put_s']:.3f}, slowest load {s['load_max_s']:.3f})"
                                            for n, s in syncs.items()))
    if cores is not None and max(args.workers) > cores:
        print(f"note: {max(args.workers)} workers on {cores} cores: generation cannot scale past {cores} "
              "processes; any further speed-up is one worker generating while another's episodes wait "
              "on their environment.")
    if any(c["beside_other_jobs"] for c in cells):
        print(f"*: other processes kept more than {args.foreign_max:g} cores busy on average during the cell's "
              "measured iterations (foreign_cores in the JSON): taken beside other jobs")
    if not load_gate["quiet"]:
        print(f"note: the machine was loaded (1-min load {load_gate['seen'][-1][0]:.2f} > {args.max_load}) "
              "when the run started: figures taken beside other jobs.")

    workloads = sorted({(r["episodes"], r["env_steps"], r["generated_tokens"]) for c in cells for r in c["reps"]})
    if len(workloads) > 1:
        print(f"warning: the cells did not all play the same episodes (episodes, env steps, tokens): {workloads}")
    repeats = ([{"kind": "cell", "workers": c["workers"], "inproc": c["inproc"], "delay_ms": c["delay_ms"], "rep": i,
                 **r} for c in cells for i, r in enumerate(c["reps"])]
               + [{"kind": "sync", "workers": n, "rep": i, **r} for n, s in syncs.items() for i, r in enumerate(s["runs"])])
    results = {"cells": [{k: v for k, v in c.items() if k != "reps"} for c in cells],
               "sync": {str(n): {k: v for k, v in s.items() if k != "runs"} for n, s in syncs.items()},
               "workloads": workloads, "starts": starts}
    out = run.write(repeats, results, tag=args.tag or ("" if args.model == "tiny" else args.model),
                    out=args.out, extra={"model_path": str(model_path), "weights_mib": weights_mb, "total_s": total_s,
                                         "load_gate": load_gate, "ray_version": __import__("ray").__version__})
    la = os.getloadavg()
    print(f"\nload average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f} (before: "
          f"{' '.join(f'{x:.2f}' for x in load_before)}); {total_s / 60:.1f} min; results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
