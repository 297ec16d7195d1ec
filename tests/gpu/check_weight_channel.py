"""GPU check of the weight channel (agentgym/cluster/weight_channel.py): prints one line per check,
``PASS name: ...``, ``FAIL name: ...``, ``SKIP name: why`` (and ``INFO`` lines), and exits 1 when
any check failed. Run by tests/gpu/run_gpu_checks.sh, or alone:

    PYTHONPATH=. python tests/gpu/check_weight_channel.py

Checks (each in fresh processes, started with ``spawn``; each process first makes its own
one-rank NCCL default group, as a DeepSpeed rank has, so the channel is shown to work beside it):

- ``nccl-broadcast`` (needs 2 GPUs): rank 0 on cuda:0 sends a model's weights (float32, bfloat16,
  non-contiguous views) to rank 1 on cuda:1, bucketed and one tensor at a time; SHA-256 equal.
  On one GPU it is a SKIP, not a pass: NCCL (>= 2.5) refuses two ranks of one communicator on
  one device ("Duplicate GPU detected"). Instead, on one GPU:
- ``nccl-same-gpu-refused``: two ranks joining on the same GPU get the channel's own clear
  RuntimeError (pointing at CUDA IPC) from ``BroadcastGroup.join``;
- ``INFO nccl-raw-one-gpu``: what NCCL itself does when that refusal is bypassed (the error text,
  or that it went through and whether the bytes arrived), as evidence for the refusal above.
- ``cuda-ipc``: this process exports a model's weights on cuda:0 (``ipc_handles``: bucketed and
  per-tensor), the payload goes to another process as plain ``pickle`` bytes (as Ray would carry
  it), which opens it on the same GPU (found by UUID), copies into its own weights, drops the
  handles; SHA-256 equal; then this process drops its payload.

Not timed yet on a GPU; its own timeouts bound it to under three minutes (most of a run is
starting processes that initialise CUDA).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agentgym.cluster import weight_channel as wc  # noqa: E402

# worst cases add up to under the 180 s run_gpu_checks.sh gives this script: IPC 50 s, then on
# one GPU two pairs of 40 s (on two GPUs one pair of 50 s), each plus up to 10 s to reap its processes
PAIR_TIMEOUT_S = 50
ONE_GPU_PAIR_TIMEOUT_S = 40
JOIN_TIMEOUT_S = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nccl_version() -> str:
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def sha(t: torch.Tensor) -> str:
    b = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + b).hexdigest()


def make_weights(version: int, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """A small model's weights on ``device``: float32 and bfloat16, plus non-contiguous views."""
    torch.manual_seed(version)
    emb, lin = torch.nn.Embedding(1000, 64), torch.nn.Linear(64, 256)
    model = torch.nn.Sequential(emb, lin, torch.nn.LayerNorm(256)).to(device)
    emb.to(torch.bfloat16)
    named: list[tuple[str, torch.Tensor]] = [(n, p) for n, p in model.named_parameters()]
    named += [("lin.weight.T", lin.weight.t()), ("emb.strided", emb.weight[::7, 3::2]),
              ("scalar", torch.tensor(1.5 + version, device=device)),
              ("mask", torch.rand(33, device=device) > 0.5)]
    return named


def default_group(device: torch.device) -> None:
    """This process's own one-rank NCCL default group (what DeepSpeed gives a trainer rank)."""
    torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}",
                                         rank=0, world_size=1, device_id=device)
    t = torch.ones(1, device=device)
    torch.distributed.all_reduce(t)
    assert t.item() == 1.0


# -- pairs of processes ---------------------------------------------------------------------------


def _pair_main(target: str, rank: int, args: tuple, q) -> None:
    try:
        q.put((rank, globals()[target](rank, *args)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put((rank, {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_pair(target: str, args: tuple, timeout_s: float = PAIR_TIMEOUT_S, n: int = 2) -> dict[int, Any]:
    """Run ``target(rank, *args)`` in ``n`` spawned processes; their results by rank (a missing rank:
    it did not report within ``timeout_s``; its process is killed)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_pair_main, args=(target, r, args, q), daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < n:
            rank, res = q.get(timeout=max(0.1, deadline - time.monotonic()))
            out[rank] = res
    except queue.Empty:
        pass
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    return out


def nccl_pair(rank: int, port: int, devices: list[int], bypass_refusal: bool) -> dict:
    dev = torch.device("cuda", devices[rank])
    default_group(dev)
    if bypass_refusal:  # the probe: let NCCL itself meet two ranks on one GPU
        wc._refuse_shared_gpus = lambda *a, **k: None  # type: ignore[assignment]
    group = wc.BroadcastGroup.join("127.0.0.1", port, rank, 2, "nccl", timeout_s=JOIN_TIMEOUT_S,
                                   device=dev)
    res: dict[str, Any] = {"nccl": nccl_version()}
    try:
        if rank == 0:
            named = make_weights(1, dev)
            group.send(named, bucket_bytes=64 << 10)
            named2 = make_weights(2, dev)
            group.send(named2, bucket_bytes=0)
            res["sent"] = [{n: sha(t) for n, t in named}, {n: sha(t) for n, t in named2}]
        else:
            metas = wc.weight_metas(make_weights(1, torch.device("cpu")))  # out of band, as a caller would
            got1 = {n: sha(t) for n, t in group.receive(metas)}
            seen: dict[str, str] = {}
            group.receive(metas, on_tensor=lambda n, t: seen.__setitem__(n, sha(t)))
            res["got"] = [got1, seen]
            res["device"] = str(dev)
    finally:
        group.close()
    return res


# -- CUDA IPC ------------------------------------------------------------------------------------


def ipc_receiver(rank: int, blobs: list[bytes]) -> dict:
    torch.cuda.set_device(0)
    default_group(torch.device("cuda", 0))
    out = []
    for blob in blobs:
        payload = pickle.loads(blob)
        opened = wc.open_ipc_handles(payload)  # the device found by the GPU's UUID
        own = {m.name: torch.zeros(m.shape, dtype=m.torch_dtype, device="cuda:0") for m in payload.metas}
        for name, t in opened:
            own[name].copy_(t)  # what an engine's update_weights does
        del opened
        torch.cuda.synchronize()
        out.append({n: sha(t) for n, t in own.items()})
    return {"got": out}


def check_ipc() -> tuple[str, str]:
    dev = torch.device("cuda", 0)
    named = make_weights(3, dev)
    expected = {n: sha(t) for n, t in named}
    flat = wc.ipc_handles(named, bucket_bytes=64 << 10)
    per_tensor = wc.ipc_handles(named, bucket_bytes=0)
    blobs = [pickle.dumps(flat), pickle.dumps(per_tensor)]  # what Ray would carry
    res = run_pair("ipc_receiver", (blobs,), n=1)
    if 0 not in res:
        return "FAIL", f"the receiving process did not report within {PAIR_TIMEOUT_S} s"
    if "error" in res[0]:
        return "FAIL", f"receiver: {res[0]['error']}\n{res[0]['trace']}"
    got = res[0]["got"]
    del flat, per_tensor  # the receiver is done: the sender may free
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    bad = [(kind, n) for kind, g in zip(("bucketed", "per-tensor"), got)
           for n in expected if g.get(n) != expected[n]]
    if bad or any(set(g) != set(expected) for g in got):
        return "FAIL", f"tensors differ after IPC: {bad[:5]}"
    return "PASS", (f"{len(expected)} tensors (float32, bfloat16, bool, non-contiguous views) "
                    f"bit-exact through CUDA IPC, bucketed (64 KiB) and per-tensor, pickled payloads")


# -- main ----------------------------------------------------------------------------------------


def check_nccl_two_gpus() -> tuple[str, str]:
    res = run_pair("nccl_pair", (free_port(), [0, 1], False))
    if len(res) < 2:
        return "FAIL", f"rank(s) {sorted({0, 1} - set(res))} did not report within {PAIR_TIMEOUT_S} s"
    for r in (0, 1):
        if "error" in res[r]:
            return "FAIL", f"rank {r}: {res[r]['error']}\n{res[r]['trace']}"
    if res[0]["sent"] != res[1]["got"]:
        return "FAIL", "received weights differ from the sent ones"
    return "PASS", (f"cuda:0 -> cuda:1 bit-exact, bucketed (64 KiB) and per-tensor, beside each "
                    f"process's own NCCL default group (NCCL {res[0]['nccl']})")


def check_nccl_one_gpu() -> list[tuple[str, str, str]]:
    lines = []
    res = run_pair("nccl_pair", (free_port(), [0, 0], False), timeout_s=ONE_GPU_PAIR_TIMEOUT_S)
    errs = [res.get(r, {}).get("error", "") for r in (0, 1)]
    if all("NCCL cannot have two ranks of one group on one GPU" in e for e in errs):
        lines.append(("PASS", "nccl-same-gpu-refused", f"both ranks refused at join: {errs[0][:160]}"))
    else:
        got = {r: (res[r].get("error", "no error")[:200] if r in res else "no report") for r in (0, 1)}
        lines.append(("FAIL", "nccl-same-gpu-refused", f"expected the channel's refusal on both ranks, got {got}"))
    probe = run_pair("nccl_pair", (free_port(), [0, 0], True), timeout_s=ONE_GPU_PAIR_TIMEOUT_S)
    if len(probe) < 2:
        what = f"hung: rank(s) {sorted({0, 1} - set(probe))} did not report within {ONE_GPU_PAIR_TIMEOUT_S} s (killed)"
    elif any("error" in probe[r] for r in (0, 1)):
        what = "refused: " + " | ".join(
            f"rank {r}: " + probe[r].get("error", "ok").replace("\n", " ")[:300] for r in (0, 1))
    else:
        same = probe[0]["sent"] == probe[1]["got"]
        what = (f"NCCL {probe[0]['nccl']} accepted two ranks on one GPU (unsupported by NCCL's docs); "
                f"weights {'arrived bit-exact' if same else 'DIFFERED'}")
    lines.append(("INFO", "nccl-raw-one-gpu", what))
    lines.append(("SKIP", "nccl-broadcast", "one GPU: the NCCL broadcast between two GPUs was not run "
                  "(NCCL refuses two ranks of one communicator on one device; colocated engines use "
                  "CUDA IPC)"))
    return lines


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP weight-channel: no CUDA device")
        return 0
    print(f"INFO weight-channel: torch {torch.__version__}, {torch.cuda.device_count()} GPU(s), "
          f"{torch.cuda.get_device_name(0)}, NCCL {nccl_version()}",
          flush=True)
    failed = False
    checks: list[tuple[str, str, str]] = []
    start = time.monotonic()
    try:
        status, msg = check_ipc()
    except Exception:  # noqa: BLE001 - a check's crash is its FAIL line
        status, msg = "FAIL", traceback.format_exc()
    checks.append((status, "cuda-ipc", msg))
    print(f"{status} cuda-ipc: {msg} ({time.monotonic() - start:.0f} s)", flush=True)
    start = time.monotonic()
    try:
        if torch.cuda.device_count() >= 2:
            status, msg = check_nccl_two_gpus()
            nccl_lines = [(status, "nccl-broadcast", msg)]
        else:
            nccl_lines = check_nccl_one_gpu()
    except Exception:  # noqa: BLE001
        nccl_lines = [("FAIL", "nccl-broadcast", traceback.format_exc())]
    for status, name, msg in nccl_lines:
        print(f"{status} {name}: {msg}", flush=True)
    print(f"INFO nccl checks took {time.monotonic() - start:.0f} s", flush=True)
    checks += nccl_lines
    failed = any(s == "FAIL" for s, _, _ in checks)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    # a `timeout` from run_gpu_checks.sh: exit normally, so the daemonic children are terminated too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    sys.exit(main())
