"""Update step time at training world size 1 (in-process) vs N (resident group), and the group's
own per-iteration overhead.

    .venv/bin/python bench/update_world_size.py                        # tiny + smollm2, 8 x 512
    .venv/bin/python bench/update_world_size.py --models tiny --rows 8 --tokens 512 --reps 3

For each model: one PPO update (ppo_epochs 1, mini_batches 1, ZeRO-2, bf16, micro-batch 4) on
the same random batch of ``--rows`` sequences of ``--tokens`` tokens, all tokens trained on.
World size 1 runs a ``PolicyTrainer`` in this process with all cores; world size N a
``ResidentGroup`` of N ranks with cores / N threads each (the same cores, split). Reported per
world size: the best of ``--reps`` update times after one warm-up, as the caller sees them.
For the group also: the slowest rank's own time in ``train_on_batch`` (compute + DeepSpeed's
gradient collectives), the rest of the call (= channel overhead: sending the batch, waking the
ranks, replies), an empty command's round trip, streaming the full weights back
(``named_weights``) and start-up. Each world size runs alone (the other is closed first).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

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
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from transformers import AutoConfig, AutoTokenizer

    from agentgym.config import AlgorithmConfig, TrainerConfig
    from agentgym.training.group.driver import ResidentGroup
    from agentgym.models.folders import resolve_model
    from agentgym.training.policy_trainer import PolicyTrainer

    cores = os.cpu_count() or 1
    print(f"{cores} cores; batch {args.rows} x {args.tokens} tokens; micro-batch {args.micro}; bf16, ZeRO-2")
    for name in args.models.split(","):
        path = resolve_model(name, os.path.expanduser(args.cache))
        tok = AutoTokenizer.from_pretrained(path)
        vocab = AutoConfig.from_pretrained(path).vocab_size
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        batch = _batch(vocab, args.rows, args.tokens, pad)
        algo = AlgorithmConfig(ppo_epochs=1, mini_batches=1)
        for world in (int(w) for w in args.worlds.split(",")):
            cfg = TrainerConfig(learning_rate=1e-6, zero_stage=2, bf16=True, micro_batch_size=args.micro,
                                world_size=world)
            t0 = time.perf_counter()
            if world == 1:
                torch.set_num_threads(args.threads or cores)
                tr = PolicyTrainer(path, tok, cfg, algo)
            else:
                tr = ResidentGroup(path, tok, cfg, algo)
            start = time.perf_counter() - t0
            times, rank_times = [], []
            for rep in range(args.reps + 1):
                t0 = time.perf_counter()
                tr.train_on_batch(batch, seed=rep)
                dt = time.perf_counter() - t0
                if rep:  # the first is a warm-up
                    times.append(dt)
                    if world > 1:
                        rank_times.append(max(tr.last_rank_seconds.values()))
            t0 = time.perf_counter()
            n_weights = sum(t.numel() for _, t in tr.named_weights())
            weights_s = time.perf_counter() - t0
            threads = (args.threads or cores) if world == 1 else tr.threads_per_rank
            line = (f"{name:8s} world {world} ({threads} thr/rank): update {min(times):7.2f} s (reps {[round(t, 2) for t in times]}); "
                    f"weights out {weights_s:.2f} s ({n_weights / 1e6:.1f}M); start {start:.1f} s")
            if world > 1:
                best = times.index(min(times))
                line += (f"\n{'':8s}          slowest rank in train {rank_times[best]:.2f} s -> channel overhead "
                         f"{min(times) - rank_times[best]:.3f} s/update; empty command {tr.ping() * 1e3:.1f} ms")
            print(line, flush=True)
            tr.close()
            del tr
    sys.exit(0)


if __name__ == "__main__":
    main()
