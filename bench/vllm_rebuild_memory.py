"""RSS of a process across ``VLLMEngine.update_weights`` on the CPU backend (each one rebuilds the
``LLM``: ``_recreate_with``), and how much of its growth glibc gives back (``malloc_trim``).

Run in the vLLM env (about 20-60 s per rebuild on the shared 2-core machine):

    PYTHONPATH=. .venv-vllm/bin/python bench/vllm_rebuild_memory.py --updates 10

Model: the tiny random Qwen2 with head_dim 32 (``tests/engines/test_vllm.py``). After every
update it samples VmRSS (this process: the engine core runs in-process); after the last one it
runs ``gc.collect()`` and ``malloc_trim(0)`` and samples again, so the growth that is only
freed-but-kept heap shows as the difference. ``--trim``: ``malloc_trim(0)`` after every update. JSON under ``bench/results/`` with ``os.getloadavg()`` beside each sample.
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


def trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--updates", type=int, default=10)
    ap.add_argument("--trim", action="store_true", help="malloc_trim(0) after every update")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vllm_rebuild_memory.json"))
    args = ap.parse_args()

    import torch
    from safetensors.torch import load_file

    from agentgym.engines import create_engine
    from agentgym.models import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="vllm-rebuild-") as d:
        path = build_tiny_model(Path(d) / "tiny-hd32", hidden_size=64, heads=2, kv_heads=1)
        base = load_file(str(Path(path) / "model.safetensors"))
        samples = []
        t0 = time.perf_counter()
        engine, _ = create_engine("vllm", path, "float32", kv_cache_gb=0.25, max_model_len=1024)
        gc.collect()
        samples.append({"update": 0, "rss_mib": rss_mib(), "seconds": time.perf_counter() - t0,
                        "load": os.getloadavg()})
        print(json.dumps(samples[-1]), flush=True)
        try:
            for i in range(1, args.updates + 1):
                weights = [(k, v + i / 1000 if v.is_floating_point() else v) for k, v in base.items()]
                engine.update_weights(weights)
                del weights
                s = {"update": i, "rss_mib": rss_mib(), "seconds": time.perf_counter() - t0,
                     "load": os.getloadavg()}
                if args.trim:
                    trim()
                    s["rss_after_trim_mib"] = rss_mib()
                samples.append(s)
                print(json.dumps(s), flush=True)
            gc.collect()
            trim()
            end = {"after_final_gc_and_trim_mib": rss_mib()}
            print(json.dumps(end), flush=True)
        finally:
            engine.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"updates": args.updates, "trim_each": args.trim, "torch": torch.__version__,
                               "samples": samples, **end}, indent=1))
    first, last = samples[1], samples[-1]
    n = last["update"] - first["update"]
    if n:
        print(f"growth per rebuild (updates {first['update']}..{last['update']}): "
              f"{(last['rss_mib'] - first['rss_mib']) / n:.1f} MiB; after a final gc + malloc_trim: "
              f"{end['after_final_gc_and_trim_mib']:.1f} MiB (update {first['update']}: {first['rss_mib']:.1f})")


if __name__ == "__main__":
    main()
