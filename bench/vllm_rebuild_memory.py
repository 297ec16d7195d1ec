"""RSS of a process across ``VLLMEngine.update_weights`` on the CPU backend (each one rebuilds the
``LLM``: ``_recreate_with``), and how much of its growth glibc gives back (``malloc_trim``).

Run in the vLLM env (about 20-60 s per rebuild on the shared 2-core machine):

    PYTHONPATH=. .venv-vllm/bin/python bench/vllm_rebuild_memory.py --updates 10
    PYTHONPATH=. .venv-vllm/bin/python bench/vllm_rebuild_memory.py --model smollm2 --updates 6

Model: the tiny random Qwen2 with head_dim 32 (``tests/engines/test_vllm.py``), or ``--model``: a
name ``agentgym.models.folders.resolve_model`` takes (``smollm2``: its cached bf16 folder, run in fp32
as on a CPU without bf16) or an HF folder. After every update it samples VmRSS (this process:
the engine core runs in-process), split into anonymous memory (heap: what a leak grows) and
file-backed pages (mapped weights, libraries), with open fds, OS threads, child processes
(a leaked engine core would be one) and entries in /dev/shm; after the last one it
runs ``gc.collect()`` and ``malloc_trim(0)`` and samples again, so the growth that is only
freed-but-kept heap shows as the difference. ``--trim``: ``malloc_trim(0)`` after every update.
Writes ``bench/results/vllm_rebuild_memory-<tag>.json`` (``results_io``: config, commit, machine,
load; every sample, with ``os.getloadavg()`` beside it).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def status_kib(*keys: str) -> dict[str, float]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in keys:
            out[k] = int(v.split()[0])
    return out


def children() -> int:
    total = 0
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            total += len((task / "children").read_text().split())
        except OSError:
            pass
    return total


def probe() -> dict[str, float]:
    """RSS (total, anonymous, file-backed; MiB), fds, threads, children, /dev/shm entries."""
    st = status_kib("VmRSS", "RssAnon", "RssFile", "RssShmem", "Threads")
    try:
        shm = len(os.listdir("/dev/shm"))
    except OSError:
        shm = -1
    return {"rss_mib": st["VmRSS"] / 1024, "rss_anon_mib": st["RssAnon"] / 1024,
            "rss_file_mib": st["RssFile"] / 1024, "rss_shmem_mib": st["RssShmem"] / 1024,
            "fds": len(os.listdir("/proc/self/fd")), "threads": st["Threads"], "children": children(),
            "dev_shm": shm,
            # vLLM gc.freeze()s everything alive once an engine is up, and the engine's shutdown
            # unfreezes: after a rebuild this is the count of live Python objects, so a leak of
            # Python objects per rebuild shows here, native memory only in rss_anon_mib.
            "gc_frozen": gc.get_freeze_count()}


def live_tensors() -> dict[str, float]:
    """CPU tensors reachable by the GC (count, MiB of their storages): a leaked copy of the weights
    shows here. Unfreezes to see frozen objects, then freezes again, as vLLM left it."""
    import torch

    frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    seen, n, nbytes = set(), 0, 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and not o.is_meta:
            n += 1
            try:
                st = o.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if st.data_ptr() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                nbytes += st.nbytes()
    if frozen:
        gc.freeze()
    return {"tensors": n, "tensor_mib": round(nbytes / 2**20, 1)}


def object_types() -> dict[str, int]:
    """Live objects per type (unfreezes to see frozen ones, then freezes again, as vLLM left it)."""
    from collections import Counter

    frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    counts = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())
    if frozen:
        gc.freeze()
    return dict(counts)


def trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--updates", type=int, default=10)
    ap.add_argument("--model", default="tiny-hd32",
                    help="tiny-hd32 (built here), or a name resolve_model takes (smollm2) or an HF folder")
    ap.add_argument("--trim", action="store_true", help="malloc_trim(0) after every update")
    ap.add_argument("--no-engine-trim", action="store_true",
                    help="switch off the engine's malloc_trim after each rebuild (to measure without it)")
    ap.add_argument("--object-diff", action="store_true",
                    help="print the object types whose count grew over each update (a few seconds each)")
    ap.add_argument("--tensors", action="store_true",
                    help="also count live tensors and their MiB after every update (a few seconds each)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/vllm_rebuild_memory-<tag>.json)")
    ap.add_argument("--tag", default="", help="the record's name (default: the UTC time)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    import results_io

    run = results_io.Run("vllm_rebuild_memory", args)

    import torch
    from safetensors.torch import load_file

    from agentgym.rollout.engines import create_engine
    from agentgym.models.folders import build_tiny_model, resolve_model

    if args.no_engine_trim:
        import agentgym.rollout.engines.vllm as vllm_engine

        vllm_engine.release_freed_heap = lambda: False

    with tempfile.TemporaryDirectory(prefix="vllm-rebuild-") as d:
        if args.model == "tiny-hd32":
            path = build_tiny_model(Path(d) / "tiny-hd32", hidden_size=64, heads=2, kv_heads=1)
        else:
            path = resolve_model(args.model)
        base = load_file(str(Path(path) / "model.safetensors"))
        samples = []
        t0 = time.perf_counter()
        engine, _ = create_engine("vllm", path, "float32", kv_cache_gb=0.25, max_model_len=1024)
        gc.collect()
        samples.append({"update": 0, **probe(), "seconds": time.perf_counter() - t0,
                        "load": os.getloadavg()})
        print(json.dumps(samples[-1]), flush=True)
        types = object_types() if args.object_diff else {}
        try:
            for i in range(1, args.updates + 1):
                # perturbed in place: this script allocates nothing per update, so what grows
                # is the engine's
                with torch.no_grad():
                    for v in base.values():
                        if v.is_floating_point():
                            v.add_(1 / 1000)
                engine.update_weights(base.items())
                s = {"update": i, **probe(), "seconds": time.perf_counter() - t0,
                     "load": os.getloadavg()}
                if args.tensors:
                    s.update(live_tensors())
                if args.object_diff:
                    now = object_types()
                    grew = sorted(((now[k] - types.get(k, 0), k) for k in now if now[k] > types.get(k, 0)), reverse=True)
                    s["objects_grew"] = {k: n for n, k in grew[:25]}
                    types = now
                if args.trim:
                    trim()
                    s["rss_after_trim_mib"] = rss_mib()
                samples.append(s)
                print(json.dumps(s), flush=True)
            gc.collect()
            trim()
            end = {"after_final_gc_and_trim_mib": rss_mib(), "after_final": probe()}
            print(json.dumps(end), flush=True)
        finally:
            engine.close()
    first, last = samples[1] if len(samples) > 1 else samples[0], samples[-1]
    n = last["update"] - first["update"]
    growth = {"rss_mib_per_rebuild": (last["rss_mib"] - first["rss_mib"]) / n,
              "rss_anon_mib_per_rebuild": (last["rss_anon_mib"] - first["rss_anon_mib"]) / n} if n else {}
    out = run.write(samples, {**end, **growth}, out=args.out,
                    extra={"model": args.model, "updates": args.updates, "trim_each": args.trim,
                           "engine_trim": not args.no_engine_trim})
    print(f"results: {out}")
    if n:
        print(f"growth per rebuild (updates {first['update']}..{last['update']}): "
              f"{(last['rss_mib'] - first['rss_mib']) / n:.1f} MiB RSS, "
              f"{(last['rss_anon_mib'] - first['rss_anon_mib']) / n:.1f} MiB anonymous, "
              f"{(last['gc_frozen'] - first['gc_frozen']) / n:.0f} Python objects; after a final gc + malloc_trim: "
              f"{end['after_final_gc_and_trim_mib']:.1f} MiB (update {first['update']}: {first['rss_mib']:.1f})")


if __name__ == "__main__":
    main()
