"""Update step time at training world size 1 (in-process) vs N (rank actors of a
``RayTrainerGroup`` on an embedded Ray cluster), and the group's own costs.

    .venv/bin/python bench/update_world_size.py                        # tiny + smollm2, 8 x 512
    .venv/bin/python bench/update_world_size.py --models tiny --rows 8 --tokens 512 --reps 3

For each model: one PPO update (ppo_epochs 1, mini_batches 1, ZeRO-2, bf16, micro-batch 4) on
the same random batch of ``--rows`` sequences of ``--tokens`` tokens, all tokens trained on.
World size 1 runs a ``PolicyTrainer`` in this process with all cores; world size N a
``RayTrainerGroup`` of N rank actors on an embedded single-node cluster (``ray.address: local``),
each rank a bundle of cores / N CPUs and as many torch threads (the same cores, split). Reported
per world size: the best of ``--reps`` update times after one warm-up, as the caller sees them
(``train_on_batch``: for the group that includes putting the batch into Ray's object store, the
call to every rank and the step count read back; every rep in ``bench/results/update_world_size-<tag>.json``, ``results_io``); the full weights to this process
(``named_weights``); start-up (the trainer's construction; for the group also the cluster's own
start, given apart). For the group also: an empty call's round trip to every rank (a
``TrainerRank.pid`` call on each, best of 20; every group call pays two: the call and the step
count) and the batch's ``ray.put``. Each world size runs alone (the other is closed first).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch


def _batch(vocab: int, rows: int, tokens: int, pad_id: int):
    from agentgym.training.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(rows):
        ids = torch.randint(10, vocab, (tokens,), generator=g).tolist()
        mask = [0] * 16 + [1] * (tokens - 16)
        out.append({"input_ids": ids, "loss_mask": mask,
                    "old_logprobs": [(-5.0 if m else 0.0) for m in mask],
                    "advantages": [(1.0 if i % 2 else -1.0) * m for m in mask]})
    return TrainBatch.from_rows(out, pad_id)


def _times(fn, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--cache", default="~/.cache/agentgym/models")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads at world size 1 (0: all cores; ranks get cores / N each)")
    ap.add_argument("--tag", default="", help="the record's name: bench/results/update_world_size-<tag>.json "
                    "(default: the UTC time)")
    args = ap.parse_args()
    import results_io  # bench/, the script's folder, is on sys.path

    run = results_io.Run("update_world_size", args)
    repeats: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from transformers import AutoConfig, AutoTokenizer

    from agentgym.config import AlgorithmConfig, RayConfig, TrainerConfig
    from agentgym.models.folders import resolve_model
    from agentgym.training.policy_trainer import PolicyTrainer

    cores = os.cpu_count() or 1
    worlds = [int(w) for w in args.worlds.split(",")]
    cluster_s = None
    print(f"{cores} cores; batch {args.rows} x {args.tokens} tokens; micro-batch {args.micro}; bf16, ZeRO-2")
    for name in args.models.split(","):
        path = resolve_model(name, os.path.expanduser(args.cache))
        tok = AutoTokenizer.from_pretrained(path)
        vocab = AutoConfig.from_pretrained(path).vocab_size
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        batch = _batch(vocab, args.rows, args.tokens, pad)
        algo = AlgorithmConfig(ppo_epochs=1, mini_batches=1)
        for world in worlds:
            cfg = TrainerConfig(learning_rate=1e-6, zero_stage=2, bf16=True, micro_batch_size=args.micro,
                                world_size=world)
            tr: Any
            if world == 1:
                threads = args.threads or cores
                torch.set_num_threads(threads)
                t0 = time.perf_counter()
                tr = PolicyTrainer(path, tok, cfg, algo)
            else:
                import ray

                from agentgym.cluster.ray_runtime import ensure_ray
                from agentgym.cluster.trainer_group import RayTrainerGroup

                threads = max(1, cores // world)
                ray_cfg = RayConfig(address="local", cpus_per_rank=threads, num_cpus=max(cores, threads * world))
                if cluster_s is None:  # the embedded cluster starts once, with the first group
                    cluster_s = ensure_ray(ray_cfg)["seconds"]
                t0 = time.perf_counter()
                tr = RayTrainerGroup(path, tok, cfg, algo, ray_cfg=ray_cfg)
            start = time.perf_counter() - t0
            times = []
            for rep in range(args.reps + 1):
                t0 = time.perf_counter()
                tr.train_on_batch(batch, seed=rep)
                if rep:  # the first is a warm-up
                    times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            n_weights = sum(t.numel() for _, t in tr.named_weights())
            weights_s = time.perf_counter() - t0
            repeats += [{"model": name, "world": world, "rep": i + 1, "update_s": t} for i, t in enumerate(times)]
            cell: dict[str, Any] = {"model": name, "world": world, "threads_per_rank": threads,
                                    "update_best_s": min(times), "weights_out_s": weights_s,
                                    "weights_m": n_weights / 1e6, "start_s": start}
            line = (f"{name:8s} world {world} ({threads} thr/rank): update {min(times):7.2f} s "
                    f"(reps {[round(t, 2) for t in times]}); weights out {weights_s:.2f} s "
                    f"({n_weights / 1e6:.1f}M); start {start:.1f} s")
            if world > 1:
                ranks = tr._ranks
                empties = _times(lambda: ray.get([a.pid.remote() for a in ranks]), 20)
                puts = _times(lambda: ray.put(batch), 5)
                empty, put = min(empties), min(puts)
                nodes = len(set(tr.rank_nodes.values()))
                cell.update(empty_call_s=empties, batch_put_s=puts, nodes=nodes, cluster_start_s=cluster_s)
                line += (f"\n{'':8s}          {world} ranks on {nodes} node(s); empty call to every rank "
                         f"{empty * 1e3:.1f} ms (x2 per group call); batch ray.put {put * 1e3:.1f} ms; "
                         f"cluster start {cluster_s:.1f} s (once, not in start)")
            print(line, flush=True)
            summary.append(cell)
            tr.close()
            del tr
    print(f"results: {run.write(repeats, {'per_world': summary})}")
    sys.exit(0)


if __name__ == "__main__":
    main()
