"""Soak: many iterations of the real rollout + update loop, watching for slow leaks.

    .venv/bin/python bench/soak.py                       # 200 iterations (about 10-20 min on 2 cores)
    .venv/bin/python bench/soak.py --iterations 20 --every 5
    .venv/bin/python bench/soak.py --model smollm2 --keep-tied-groups --iterations 30 --every 1

What runs, in this process: a ``PolicySession`` (the library steps the Prefect tasks wrap) on the
tiny model (``--model``: any name ``agentgym.models.folders.resolve_model`` takes, e.g. ``smollm2``; fp32
either way, as on a CPU without bf16) with the keyword environment -- every iteration a streamed rollout committed to the
trajectory store, advantages, a DeepSpeed update and the weight sync, its metrics logged to MLflow
(SQLite); every ``--eval-every`` iterations a held-out evaluation; every ``--ckpt-every`` an HF
export to a temporary folder logged to MLflow as a checkpoint, as ``save_checkpoint`` does.

Sampled after every iteration: RSS, open file descriptors, threads (the OS's count, torch's and
SQLite's included), child processes, and files under a TMPDIR of the soak's own (so nothing else's
temp files count). Prints a table (every ``--every`` iterations) and a summary, and writes every
sample to ``bench/results/soak-<tag>.json`` (``results_io``: config, commit, machine, load; committed).

Leaks show as growth after a warm-up: the first iterations build caches (allocator arenas,
tokenizer, DeepSpeed buffers, SQLAlchemy pools); the summary compares the second half with the
middle. ``tests/reliability/test_soak.py`` runs 20 iterations with bounds on exactly that.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# ------------------------------------------------------------------ what one sample holds
def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return -1


def _children() -> int:
    pid = os.getpid()
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += len((task / "children").read_text().split())
        except OSError:
            pass
    return total


def sample(tmpdir: Path) -> dict[str, float]:
    """This process's RSS (MiB), open fds, OS threads, child processes, files under ``tmpdir``."""
    return {
        "rss_mib": _status("VmRSS") / 1024,
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": _status("Threads"),
        "children": _children(),
        "tmp_files": sum(len(files) for _, _, files in os.walk(tmpdir)),
    }


@contextlib.contextmanager
def own_tmpdir(path: Path) -> Iterator[Path]:
    """Point TMPDIR (and ``tempfile``'s cached default) at ``path`` while the soak runs."""
    path.mkdir(parents=True, exist_ok=True)
    old_env, old_cached = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = str(path), str(path)
    try:
        yield path
    finally:
        tempfile.tempdir = old_cached
        if old_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old_env


# ------------------------------------------------------------------ the loop
def config(workdir: Path, iterations: int, model_cache: str, model: str = "tiny",
           keep_tied_groups: bool = False):
    from agentgym.config import parse_config

    return parse_config({
        "run_id": "soak", "seed": 5,
        "model": {"name_or_path": model, "dtype": "float32", "cache_dir": model_cache},
        "envs": [{"name": "keyword", "tasks": [0, 1, 2, 3], "eval_tasks": [7, 8],
                  "kwargs": {"target": "aeiou", "mode": "char_share"}}],
        "rollout": {"tasks_per_iteration": 3, "group_size": 2, "max_new_tokens": 6},
        "trainer": {"learning_rate": 1e-4, "bf16": False},
        # SmolLM2's two replies to a keyword prompt often tie (after 6 updates at this learning
        # rate every group tied: 7 updates in 30 iterations); kept, every iteration runs the
        # DeepSpeed step and the weight sync, the paths a leak would be in.
        "algorithm": {"skip_tied_groups": not keep_tied_groups},
        "schedule": {"stages": [{"horizon": 2, "iterations": iterations}]},
        "store": {"root": str(workdir / "store")},
        "tracking": {"tracking_uri": f"sqlite:///{workdir}/mlflow.db", "experiment": "soak"},
    })


def soak(workdir: Path, iterations: int = 200, eval_every: int = 5, ckpt_every: int = 10,
         model_cache: str = "~/.cache/agentgym/models", on_sample=None,
         model: str = "tiny", keep_tied_groups: bool = False) -> list[dict[str, float]]:
    """Run the loop for ``iterations``; returns one sample per iteration (index 0: before the
    first), each with the 1-minute load average beside it (the machine is shared).
    ``on_sample(i, sample)`` is called as they come."""
    from agentgym.infra import tempdirs
    from agentgym.evaluation.metrics import evaluate
    from agentgym.pipeline import IterationRef, PolicySession
    from agentgym.tracking.tracker import Tracker

    workdir = Path(workdir)
    with own_tmpdir(workdir / "tmp") as tmp:
        cfg = config(workdir, iterations, model_cache, model, keep_tied_groups)
        tracker = Tracker(cfg.tracking.tracking_uri, cfg.tracking.experiment)
        parent = tracker.pipeline_run("soak", {"run_id": "soak"})
        stage = tracker.stage_run(parent, "soak", 0, horizon=2, iterations=iterations)
        session = PolicySession(cfg, "soak")
        samples = [{"iteration": 0, "seconds": 0.0, "policy_version": 0, "load1": os.getloadavg()[0],
                    **sample(tmp)}]
        t0 = time.perf_counter()
        try:
            for it in range(iterations):
                ref = IterationRef(0, it, it)
                metrics = session.collect(ref, horizon=2)
                metrics.update(session.advantages(ref))
                metrics.update(session.update(ref))
                tracker.log_metrics_once([stage, parent], metrics, step=it)
                if (it + 1) % eval_every == 0:
                    report = evaluate(session.engine, session.formatter, cfg, k=1, horizon=2, seed=it)
                    tracker.log_metrics(stage, report.metrics("eval"), step=it)
                if (it + 1) % ckpt_every == 0:
                    with tempdirs.scratch("agentgym-ckpt-") as ckpt:
                        session.export(ckpt)
                        tracker.log_checkpoint(stage, ckpt, it + 1, meta={"run_id": "soak"})
                s = {"iteration": it + 1, "seconds": time.perf_counter() - t0,
                     "policy_version": session.policy_version, "load1": os.getloadavg()[0], **sample(tmp)}
                samples.append(s)
                if on_sample:
                    on_sample(it + 1, s)
        finally:
            session.close()
    return samples


def summary(samples: list[dict[str, float]]) -> dict[str, float]:
    """Growth over the second half (middle sample -> last) and over the whole run."""
    first, mid, last = samples[1], samples[len(samples) // 2], samples[-1]
    out = {"iterations": last["iteration"], "seconds": round(last["seconds"], 1),
           "updates": last["policy_version"]}
    for key in ("rss_mib", "fds", "threads", "children", "tmp_files"):
        out[f"{key}_start"], out[f"{key}_mid"], out[f"{key}_end"] = samples[0][key], mid[key], last[key]
        out[f"{key}_max"] = max(s[key] for s in samples)
    out["rss_growth_second_half_mib"] = round(last["rss_mib"] - mid["rss_mib"], 1)
    out["rss_growth_after_first_mib"] = round(last["rss_mib"] - first["rss_mib"], 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="a name resolve_model takes (tiny, smollm2) or an HF folder")
    ap.add_argument("--keep-tied-groups", action="store_true",
                    help="update even on groups whose rewards tie (algorithm.skip_tied_groups false): "
                    "one update and weight sync per iteration whatever the replies")
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--every", type=int, default=10, help="print a table row every N iterations")
    ap.add_argument("--model-cache", default="~/.cache/agentgym/models")
    ap.add_argument("--out", default=None, help="folder for the record (default bench/results/)")
    ap.add_argument("--tag", default="", help="the record's name: soak-<tag>.json (default: the UTC time)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    import results_io

    run = results_io.Run("soak", args)

    import torch

    torch.set_num_threads(1)  # two cores shared with other work: one thread is faster here
    cols = ("iteration", "seconds", "load1", "rss_mib", "fds", "threads", "children", "tmp_files")
    print(" ".join(f"{c:>9}" for c in cols))

    def show(i: int, s: dict) -> None:
        if i == 1 or i % args.every == 0 or i == args.iterations:
            print(" ".join(f"{s[c]:>9.1f}" if isinstance(s[c], float) else f"{s[c]:>9}" for c in cols), flush=True)

    with tempfile.TemporaryDirectory(prefix="agentgym-soak-") as work:
        samples = soak(Path(work), args.iterations, args.eval_every, args.ckpt_every,
                       os.path.expanduser(args.model_cache), on_sample=show, model=args.model,
                       keep_tied_groups=args.keep_tied_groups)
    result = summary(samples)
    print(json.dumps(result, indent=2))
    tag = results_io.default_tag(args)
    path = run.write(samples, result, tag=tag,
                     out=Path(args.out) / f"soak-{tag}.json" if args.out else None)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
