"""The weight channel's broadcast group (gloo on CPU, two processes each with its own default group
first, as DeepSpeed ranks and vLLM workers have) and its pure parts; CUDA IPC refusing without CUDA.

The NCCL and CUDA IPC paths themselves run in tests/gpu/check_weight_channel.py.
"""

from __future__ import annotations

import hashlib
import queue
import socket
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from agentgym.cluster.weight_channel import (
    ALIGN_BYTES,
    BroadcastGroup,
    IpcPayload,
    Slot,
    TensorMeta,
    duplicate_devices,
    ipc_handles,
    metas_digest,
    open_ipc_handles,
    plan_buckets,
    weight_metas,
)
TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sha(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's elements as bytes, with its dtype and shape (bit equality)."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + b).hexdigest()


def make_weights(version: int) -> list[tuple[str, torch.Tensor]]:
    """A small model's named weights plus awkward cases: float32 and bfloat16, non-contiguous
    views (a transpose, a strided slice, an expanded tensor), a 0-dim and an empty tensor, int64,
    bool, and a bfloat16 tensor of odd byte length (slot alignment)."""
    torch.manual_seed(1000 + version)
    emb, lin = torch.nn.Embedding(50, 12), torch.nn.Linear(12, 7)
    model = torch.nn.Sequential(emb, lin, torch.nn.LayerNorm(7))
    emb.to(torch.bfloat16)
    # Parameters (requires_grad), then views and odd tensors
    named: list[tuple[str, torch.Tensor]] = [(n, p) for n, p in model.named_parameters()]
    named += [
        ("lin.weight.T", lin.weight.t()),
        ("emb.strided", emb.weight[::3, 1::2]),
        ("expanded", torch.randn(1, 5).expand(4, 5)),
        ("scalar", torch.tensor(3.25 + version)),
        ("empty", torch.zeros(0, 3, dtype=torch.bfloat16)),
        ("steps", torch.arange(9, dtype=torch.int64) * (version + 1)),
        ("mask", torch.rand(11) > 0.5),
        ("odd.bf16", torch.randn(3, 3).to(torch.bfloat16)),
        ("subnormal", torch.tensor([1e-40, -0.0, float("inf"), float("nan")])),
    ]
    return named


def _rank_main(rank: int, port: int, ranks_port: int, q_metas, q_out) -> None:
    """One process: its own 1-rank default gloo group first (a DeepSpeed rank's), then the
    weight channel with the other process on ``ranks_port``."""
    try:
        torch.set_num_threads(1)
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                             rank=0, world_size=1)
        group = BroadcastGroup.join("127.0.0.1", ranks_port, rank, 2, "gloo", timeout_s=TIMEOUT_S)
        results: dict[str, object] = {}
        if rank == 0:
            # sync 1: small buckets (several tensors a bucket, and several buckets)
            named = make_weights(1)
            metas = weight_metas(named)
            q_metas.put(metas)
            sent = group.send(named, bucket_bytes=1024)
            results["sent1"] = {n: sha(t) for n, t in named}
            results["metas_equal"] = sent == metas
            # sync 2: other weights, one collective per tensor
            named2 = make_weights(2)
            group.send(named2, bucket_bytes=0)
            results["sent2"] = {n: sha(t) for n, t in named2}
            # sync 3: the receiver was given wrong metas -> both sides raise, nothing hangs
            try:
                group.send(named2)
            except ValueError as exc:
                results["mismatch"] = str(exc)
            # sync 4: the group still works after the refused sync (default bucket size)
            named4 = make_weights(4)
            group.send(named4)
            results["sent4"] = {n: sha(t) for n, t in named4}
        else:
            metas = q_metas.get(timeout=TIMEOUT_S)
            got = group.receive(metas)
            results["got1"] = {n: sha(t) for n, t in got}
            results["got1_names"] = [n for n, _ in got]
            results["got1_dtypes"] = sorted({str(t.dtype) for _, t in got})
            seen: dict[str, str] = {}
            kept = group.receive(metas, on_tensor=lambda n, t: seen.__setitem__(n, sha(t)))
            results["got2"] = seen
            results["kept2"] = len(kept)
            wrong = list(metas)
            wrong[1] = TensorMeta(wrong[1].name, (wrong[1].shape[0] + 1,) + wrong[1].shape[1:],
                                  wrong[1].dtype)
            try:
                group.receive(wrong)
            except ValueError as exc:
                results["mismatch"] = str(exc)
            results["got4"] = {n: sha(t) for n, t in group.receive(metas)}
        group.close()
        # the default group is still this process's own one-rank group, and works
        t = torch.ones(1)
        torch.distributed.all_reduce(t)
        results["default_world"] = (torch.distributed.get_world_size(), float(t.item()))
        torch.distributed.destroy_process_group()
        q_out.put((rank, results))
    except BaseException:  # noqa: BLE001 - reported to the test
        q_out.put((rank, {"error": traceback.format_exc()}))


def test_broadcast_group_beside_default_groups_bit_exact():
    ctx = mp.get_context("spawn")
    q_metas, q_out = ctx.Queue(), ctx.Queue()
    ranks_port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, free_port(), ranks_port, q_metas, q_out))
             for r in range(2)]
    for p in procs:
        p.start()
    out: dict[int, dict] = {}
    try:
        for _ in procs:
            rank, res = q_out.get(timeout=TIMEOUT_S)
            out[rank] = res
    except queue.Empty:
        pytest.fail(f"a rank did not report within {TIMEOUT_S} s; got {sorted(out)}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for r in (0, 1):
        assert "error" not in out[r], out[r].get("error")
    sender, receiver = out[0], out[1]

    expected1 = {n: sha(t) for n, t in make_weights(1)}
    assert sender["sent1"] == expected1  # the sender's own weights are what the test expects
    assert receiver["got1"] == expected1
    assert receiver["got1_names"] == [n for n, _ in make_weights(1)]
    assert receiver["got1_dtypes"] == ["torch.bfloat16", "torch.bool", "torch.float32", "torch.int64"]
    assert sender["metas_equal"]
    assert receiver["got2"] == sender["sent2"] == {n: sha(t) for n, t in make_weights(2)}
    assert receiver["got2"] != receiver["got1"]
    assert receiver["kept2"] == 0
    assert "expected other weights" in sender["mismatch"]
    assert "rank 0 sends other weights" in receiver["mismatch"]
    assert receiver["got4"] == sender["sent4"] == {n: sha(t) for n, t in make_weights(4)}
    assert sender["default_world"] == receiver["default_world"] == (1, 1.0)


def test_plan_buckets_packs_in_order_aligned():
    metas = [TensorMeta("a", (10,), "float32"), TensorMeta("b", (3,), "bfloat16"),
             TensorMeta("big", (1000,), "float32"), TensorMeta("c", (0, 4), "float32"),
             TensorMeta("d", (2,), "int64")]
    slots, sizes = plan_buckets(metas, 512)
    # b starts at the next aligned offset; big is alone; the empty c takes no room, so d
    # starts its bucket at 0
    assert slots == [Slot(0, 0, 40), Slot(0, ALIGN_BYTES, 6), Slot(1, 0, 4000),
                     Slot(2, 0, 0), Slot(2, 0, 16)]
    assert sizes == [ALIGN_BYTES + 6, 4000, 16]
    per_tensor, sizes0 = plan_buckets(metas, 0)
    assert [s.bucket for s in per_tensor] == [0, 1, 2, 3, 4] and sizes0 == [40, 6, 4000, 0, 16]


def test_metas_and_digest():
    named = make_weights(1)
    metas = weight_metas(named)
    assert metas[0] == TensorMeta("0.weight", (50, 12), "bfloat16")
    assert metas[0].torch_dtype is torch.bfloat16 and metas[0].nbytes == 50 * 12 * 2
    assert metas_digest(metas) == metas_digest(weight_metas(make_weights(2)))  # same layout
    swapped = [metas[1], metas[0]] + metas[2:]
    assert metas_digest(swapped) != metas_digest(metas)
    retyped = [TensorMeta(metas[0].name, metas[0].shape, "float16")] + metas[1:]
    assert metas_digest(retyped) != metas_digest(metas)
    with pytest.raises(ValueError, match="not a torch dtype"):
        TensorMeta("x", (1,), "Linear").torch_dtype


def test_duplicate_devices_names_the_ranks_nccl_refuses():
    assert duplicate_devices(["GPU-a", "GPU-b", "GPU-c"]) == []
    assert duplicate_devices(["GPU-a", "GPU-b", "GPU-a", "GPU-a"]) == [(0, 2, "GPU-a"), (0, 3, "GPU-a")]


def test_nccl_group_refuses_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: tests/gpu/check_weight_channel.py covers nccl")
    with pytest.raises(RuntimeError, match="needs CUDA"):
        BroadcastGroup.join("127.0.0.1", free_port(), 0, 2, "nccl", timeout_s=1)


def test_cuda_ipc_refuses_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: tests/gpu/check_weight_channel.py covers CUDA IPC")
    with pytest.raises(RuntimeError, match=r"CUDA IPC .* needs CUDA \(torch.cuda.is_available\(\) is False"):
        ipc_handles(make_weights(1))
    with pytest.raises(RuntimeError, match="open_ipc_handles: CUDA IPC"):
        open_ipc_handles(IpcPayload("GPU-x", (), (), True, ()))


def test_ipc_payload_pickles_without_its_keepalive():
    import pickle

    p = IpcPayload("GPU-x", (TensorMeta("a", (2,), "float32"),), (Slot(0, 0, 8),), True, (),
                   keepalive=(torch.zeros(2),))
    q = pickle.loads(pickle.dumps(p))
    assert q == p and q.keepalive == ()


def test_join_refuses_two_ranks_on_one_gpu_before_nccl(monkeypatch):
    """The UUID exchange join does for nccl: the ranks that share a GPU are named, CUDA IPC pointed at."""
    from torch._C._distributed_c10d import PrefixStore, TCPStore

    from agentgym.cluster import weight_channel as wc

    monkeypatch.setattr(wc, "gpu_uuid", lambda device=None: "GPU-same")
    store = PrefixStore(wc.STORE_PREFIX, TCPStore("127.0.0.1", free_port(), 2, True, wait_for_workers=False))
    store.set("gpu/1", "GPU-same")  # what rank 1 would have written
    with pytest.raises(RuntimeError, match=r"ranks 0 and 1 on GPU GPU-same.*CUDA IPC"):
        wc._refuse_shared_gpus(store, 0, 2, torch.device("cpu"))
    store.set("gpu/1", "GPU-other")
    wc._refuse_shared_gpus(store, 0, 2, torch.device("cpu"))  # distinct GPUs: no complaint
