"""The weight channel's GPU backends: full policy weights from training rank 0 to rollout engines.

Plain torch, no Ray: the Ray actors (``agentgym.cluster``'s runtime, trainer group and rollout
pool) call these functions inside their processes and carry the small picklable pieces
(:class:`TensorMeta` lists, :class:`IpcPayload`) between them themselves. On CPU the weights
travel through Ray's object store instead; that path is not here.

Two backends, as OpenRLHF does it (``vllm_worker_wrap.py``: ``update_weight`` by NCCL broadcast,
``update_weight_cuda_ipc`` when colocated):

**Broadcast group** (:class:`BroadcastGroup`): trainer rank 0 and every engine process (ranks
1..N) form an extra process group of their own, rendezvousing on a ``TCPStore`` that rank 0
serves on ``host:port``. It is *not* registered with ``torch.distributed``: the trainer ranks
already have DeepSpeed's default group (and a vLLM worker its own), and ``torch.distributed.
new_group`` can only carve subgroups out of that one default group, which the engines are not
in. So the group is built the way ``torch.distributed._dist2`` (torch >= 2.8, experimental) and
vLLM's ``stateless_init_torch_distributed_process_group`` build theirs: a ``ProcessGroup`` over a
``PrefixStore`` with one backend (``ProcessGroupNCCL`` on GPU, ``ProcessGroupGloo`` on CPU, for
tests) registered for its device, used only through its own methods (``pg.broadcast``), never
through ``torch.distributed.broadcast(group=...)`` (that looks the group up in the global tables).

One sync (``send`` on rank 0, ``receive`` on the others, at the same time):

1. the caller gets ``metas = weight_metas(named)`` on rank 0 and hands the list to every engine
   out of band (a Ray call argument); it only changes when the model's parameter set does;
2. a header broadcast (the digest of the sender's metas, its bucket size, the tensor count) and
   an all-reduce of "do my metas agree": a receiver with other metas makes *every* rank raise a
   clear ``ValueError`` right there instead of mis-slicing bytes or hanging until the timeout;
3. the tensors, as raw bytes, packed in order into flat ``uint8`` buckets of at most
   ``bucket_bytes`` (a tensor larger than that travels alone; ``bucket_bytes=0``: one collective
   per tensor), one broadcast per bucket: a few hundred collectives become a handful, and any
   dtype (bfloat16, bool, ...) travels on any backend;
4. each receiver slices its bucket back into ``(name, tensor)`` and hands them to ``on_tensor``
   (the engine's ``update_weights``) as each bucket arrives.

NCCL refuses two ranks of one communicator on one GPU (NCCL >= 2.5: ``ncclInvalidUsage``,
"Duplicate GPU detected : rank 0 and rank 1 both on CUDA device ..."; its docs: "Using the same
CUDA device multiple times as different ranks of the same NCCL communicator is not supported").
:meth:`BroadcastGroup.join` therefore exchanges the GPUs' UUIDs through the store first and
refuses such a group itself, naming the ranks and pointing at CUDA IPC, which is the backend for
an engine that shares the trainer's GPU.

**CUDA IPC** (:func:`ipc_handles` / :func:`open_ipc_handles`): the trainer's process exports
handles to GPU memory (``torch.multiprocessing.reductions.reduce_tensor``: the cudaIpc memory
handle of the allocation, offsets, shape, stride, dtype, a ref-counter and an event), picklable;
the engine's process on the same physical GPU opens them (no copy), copies into its own weights
and drops them; then the trainer may drop its payload. Either one handle per tensor (no copy on
the sender, non-contiguous views included) or byte buckets as above (one copy on the sender,
a handful of handles). Without CUDA both functions refuse with a ``RuntimeError``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch._C._distributed_c10d import (
    AllreduceOptions,
    BroadcastOptions,
    PrefixStore,
    ProcessGroup,
    ReduceOp,
    TCPStore,
)

#: Default bucket size of a broadcast or an IPC export (bytes). Large enough that a 135M-7B
#: model is a few to a few dozen collectives, small enough that a bucket's extra copy on the
#: receiving engine's GPU stays a small fraction of its KV-cache headroom.
DEFAULT_BUCKET_BYTES = 256 << 20
#: Byte offsets inside a bucket are multiples of this (every dtype's element size divides it, so
#: a slice views back as its dtype; 256 is also the CUDA allocator's alignment).
ALIGN_BYTES = 256
#: The store keys of this channel live under this prefix (the store serves nothing else, but a
#: caller may hand in a shared port by mistake; the prefix keeps keys apart).
STORE_PREFIX = "agentgym/weight-channel"

OnTensor = Callable[[str, torch.Tensor], None]
NamedTensors = Iterable[tuple[str, torch.Tensor]]


# ---------------------------------------------------------------------------------------------
# metadata and byte layout (pure; shared by both backends)


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to allocate one tensor: its name, shape and dtype.

    ``dtype`` is the torch dtype's name without the ``torch.`` prefix (``"bfloat16"``), so a list of
    metas pickles and compares without torch objects in it.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` (or ``"torch.bfloat16"``) -> ``torch.bfloat16``; anything else -> ValueError."""
    found = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return found


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def weight_metas(named: NamedTensors) -> list[TensorMeta]:
    """The metas of ``named`` (e.g. ``trainer.named_weights()``), in order.

    Rank 0 calls it and hands the list to every receiver out of band; ``receive`` allocates from
    it and checks it against the sender's digest.
    """
    return [TensorMeta(name, tuple(int(s) for s in t.shape), dtype_name(t.dtype)) for name, t in named]


def metas_digest(metas: Sequence[TensorMeta]) -> int:
    """A signed 64-bit digest of the metas (names, shapes, dtypes, order): what the header carries."""
    h = hashlib.sha256()
    for m in metas:
        h.update(f"{m.name}\x00{','.join(map(str, m.shape))}\x00{m.dtype}\n".encode())
    return int.from_bytes(h.digest()[:8], "little", signed=True)


@dataclass(frozen=True)
class Slot:
    """Where one tensor's bytes sit: bucket index, byte offset in the bucket, byte count."""

    bucket: int
    offset: int
    nbytes: int


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> tuple[list[Slot], list[int]]:
    """Pack the tensors, in order, into byte buckets of at most ``bucket_bytes`` (offsets aligned
    to ``ALIGN_BYTES``); a tensor larger than ``bucket_bytes`` gets a bucket of its own;
    ``bucket_bytes <= 0``: one bucket per tensor.

    Returns ``(slots, bucket_sizes)``: one slot per meta, and each bucket's size in bytes. Sender
    and receivers compute the same plan from the same metas and bucket size.
    """
    slots: list[Slot] = []
    sizes: list[int] = []
    for m in metas:
        n = m.nbytes
        if sizes and bucket_bytes > 0 and _align(sizes[-1]) + n <= bucket_bytes:
            offset = _align(sizes[-1])
            sizes[-1] = offset + n
        else:
            offset = 0
            sizes.append(n)
        slots.append(Slot(len(sizes) - 1, offset, n))
    return slots, sizes


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as a flat ``uint8`` tensor (a view when it is contiguous, else a copy)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def _from_bytes(buf: torch.Tensor, slot: Slot, meta: TensorMeta) -> torch.Tensor:
    """The tensor ``meta`` describes, as a view of ``buf`` (a flat ``uint8`` bucket) at ``slot``."""
    return buf[slot.offset: slot.offset + slot.nbytes].view(meta.torch_dtype).view(meta.shape)


def _pack(tensors: Sequence[torch.Tensor], slots: Sequence[Slot], size: int,
          device: torch.device) -> torch.Tensor:
    """One bucket: the given tensors' bytes at their slots, in a new ``uint8`` buffer on ``device``.
    A single contiguous tensor already on ``device`` that fills the bucket is sent as it is."""
    if len(tensors) == 1 and tensors[0].device == device and tensors[0].is_contiguous() \
            and slots[0].offset == 0:
        return _as_bytes(tensors[0])
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    for t, s in zip(tensors, slots):
        buf[s.offset: s.offset + s.nbytes].copy_(_as_bytes(t))
    return buf


def _check_named(named: Sequence[tuple[str, torch.Tensor]]) -> None:
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(t).__name__}, not a tensor")
        if t.is_sparse or t.layout != torch.strided:
            raise ValueError(f"weight {name!r} has layout {t.layout}: only dense tensors travel")


# ---------------------------------------------------------------------------------------------
# NCCL / gloo broadcast group


def gpu_uuid(device: torch.device | int | None = None) -> str:
    """The physical GPU's UUID of a CUDA device (the same string in every process that sees that
    GPU, whatever its ``CUDA_VISIBLE_DEVICES`` numbering)."""
    index = device.index if isinstance(device, torch.device) else device
    if index is None:
        index = torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def duplicate_devices(uuids: Sequence[str]) -> list[tuple[int, int, str]]:
    """``(first_rank, rank, uuid)`` for every rank whose GPU an earlier rank already uses: the
    ranks NCCL would refuse ("Duplicate GPU detected")."""
    first: dict[str, int] = {}
    dups: list[tuple[int, int, str]] = []
    for rank, u in enumerate(uuids):
        if u in first:
            dups.append((first[u], rank, u))
        else:
            first.setdefault(u, rank)
    return dups


class BroadcastGroup:
    """A process group of trainer rank 0 (rank 0, the sender) and the rollout engines (ranks
    1..world_size-1, the receivers), separate from any default group the processes have.

    Every member calls :meth:`join` at the same time; then, per sync, rank 0 calls :meth:`send`
    while every other rank calls :meth:`receive` with the metas rank 0 handed out. Collectives
    run on the calling thread, one sync at a time; sends and receives must pair up in order.
    """

    def __init__(self, pg: ProcessGroup, store: TCPStore, rank: int, world_size: int,
                 backend: str, device: torch.device, timeout: timedelta) -> None:
        self._pg: ProcessGroup | None = pg
        self._store: TCPStore | None = store
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.timeout = timeout

    @classmethod
    def join(cls, host: str, port: int, rank: int, world_size: int, backend: str = "nccl",
             timeout_s: float = 300.0, device: torch.device | str | None = None) -> BroadcastGroup:
        """Form (or join) the group: rank 0 serves the ``TCPStore`` on ``host:port`` (an address of
        rank 0's machine and a free port), the others connect to it; returns once all
        ``world_size`` ranks have joined (each waits up to ``timeout_s``).

        ``backend``: ``"nccl"`` (GPU; ``device`` defaults to the current CUDA device, and every
        rank must be on a different physical GPU: a duplicate raises ``RuntimeError`` here, before
        NCCL would) or ``"gloo"`` (CPU; ``device`` defaults to ``cpu``). The process's default
        group, if any, is neither needed nor touched.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', not {backend!r}")
        timeout = timedelta(seconds=timeout_s)
        if backend == "nccl":
            if not torch.cuda.is_available():
                raise RuntimeError("the nccl weight channel needs CUDA (torch.cuda.is_available() "
                                   "is False here); use backend='gloo' on CPU")
            dev = torch.device(device) if device is not None else \
                torch.device("cuda", torch.cuda.current_device())
            if dev.type != "cuda":
                raise ValueError(f"backend 'nccl' needs a CUDA device, not {dev}")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        else:
            dev = torch.device(device) if device is not None else torch.device("cpu")

        tcp = TCPStore(host, port, world_size, rank == 0, timeout, wait_for_workers=False)
        store = PrefixStore(STORE_PREFIX, tcp)
        if backend == "nccl":
            _refuse_shared_gpus(store, rank, world_size, dev)
        pg = _make_group(store, rank, world_size, backend, dev, timeout)
        return cls(pg, tcp, rank, world_size, backend, dev, timeout)

    # -- one sync ------------------------------------------------------------------------------

    def send(self, named: NamedTensors, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[TensorMeta]:
        """Rank 0: broadcast ``named`` (any devices, dtypes, strides; e.g. ``trainer.named_weights()``)
        to every receiver, ``bucket_bytes`` at a time. Returns the metas it sent (equal to
        ``weight_metas(named)``, which the receivers must have been given).

        Raises ``ValueError`` (on every rank) when a receiver's metas differ from these.
        """
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank} called send: only rank 0 sends")
        items = list(named)
        _check_named(items)
        metas = weight_metas(items)
        self._agree(metas, bucket_bytes)
        slots, sizes = plan_buckets(metas, bucket_bytes)
        by_bucket: list[list[int]] = [[] for _ in sizes]
        for i, s in enumerate(slots):
            by_bucket[s.bucket].append(i)
        with torch.no_grad():
            for b, size in enumerate(sizes):
                if size == 0:
                    continue
                idx = by_bucket[b]
                buf = _pack([items[i][1] for i in idx], [slots[i] for i in idx], size, self.device)
                self._broadcast(buf)
        return metas

    def receive(self, metas: Sequence[TensorMeta], on_tensor: OnTensor | None = None,
                device: torch.device | str | None = None) -> list[tuple[str, torch.Tensor]]:
        """Ranks 1..: receive one sync's tensors, described by ``metas`` (rank 0's
        ``weight_metas``), onto ``device`` (default: the group's device).

        Without ``on_tensor``: returns every ``(name, tensor)`` (tensors may be views of a shared
        bucket buffer). With it: calls ``on_tensor(name, tensor)`` for each tensor as its bucket
        arrives and keeps none (returns ``[]``), so an engine that copies them into its weights
        holds one bucket extra at a time. Raises ``ValueError`` when rank 0 sends other metas.
        """
        if self.rank == 0:
            raise RuntimeError("rank 0 called receive: rank 0 sends")
        metas = list(metas)
        bucket_bytes = self._agree(metas, None)
        slots, sizes = plan_buckets(metas, bucket_bytes)
        out_dev = torch.device(device) if device is not None else self.device
        kept: list[tuple[str, torch.Tensor]] = []
        i = 0
        with torch.no_grad():
            for b, size in enumerate(sizes):
                buf = torch.empty(size, dtype=torch.uint8, device=self.device)
                if size:
                    self._broadcast(buf)
                if out_dev != self.device:
                    buf = buf.to(out_dev)
                while i < len(metas) and slots[i].bucket == b:
                    t = _from_bytes(buf, slots[i], metas[i])
                    if on_tensor is not None:
                        on_tensor(metas[i].name, t)
                    else:
                        kept.append((metas[i].name, t))
                    i += 1
        return kept

    def close(self) -> None:
        """Release the group (NCCL communicators, gloo sockets) and the store. Idempotent. Other
        ranks' pending collectives fail (or time out) once a rank has closed."""
        pg, self._pg, self._store = self._pg, None, None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - a backend without shutdown is released by its refcount
                pass

    def __enter__(self) -> BroadcastGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------

    def _group(self) -> ProcessGroup:
        if self._pg is None:
            raise RuntimeError("the broadcast group is closed")
        return self._pg

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = self.timeout
        self._group().broadcast([t], opts).wait()

    def _agree(self, metas: Sequence[TensorMeta], bucket_bytes: int | None) -> int:
        """The header: rank 0 broadcasts (digest, bucket size, count); every rank votes whether
        its metas match; all raise together when one does not. Returns the bucket size."""
        header = torch.zeros(3, dtype=torch.int64, device=self.device)
        digest = metas_digest(metas)
        if bucket_bytes is not None:
            header.copy_(torch.tensor([digest, bucket_bytes, len(metas)], dtype=torch.int64))
        self._broadcast(header)
        sent_digest, sent_bucket, sent_count = (int(x) for x in header.tolist())
        ok = torch.tensor([1 if sent_digest == digest else 0], dtype=torch.int64, device=self.device)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.MIN  # type: ignore[assignment]  # the stub types it as the enum class
        opts.timeout = self.timeout
        self._group().allreduce([ok], opts).wait()
        if int(ok.item()) != 1:
            if self.rank == 0:
                raise ValueError("a receiver of the weight channel expected other weights than rank "
                                 f"0 sends ({len(metas)} tensors, digest {digest:#x}): give every "
                                 "receiver the metas of this send (weight_metas)")
            if sent_digest != digest:
                raise ValueError(f"rank 0 sends other weights ({sent_count} tensors, digest "
                                 f"{sent_digest:#x}) than this receiver's metas describe "
                                 f"({len(metas)} tensors, digest {digest:#x})")
            raise ValueError("another receiver of the weight channel expected other weights than "
                             "rank 0 sends; this sync is abandoned on every rank")
        return sent_bucket


def _refuse_shared_gpus(store: PrefixStore, rank: int, world_size: int, dev: torch.device) -> None:
    store.set(f"gpu/{rank}", gpu_uuid(dev))
    uuids = [store.get(f"gpu/{r}").decode() for r in range(world_size)]
    dups = duplicate_devices(uuids)
    if dups:
        pairs = "; ".join(f"ranks {a} and {b} on GPU {u}" for a, b, u in dups)
        raise RuntimeError(
            f"NCCL cannot have two ranks of one group on one GPU ({pairs}; NCCL >= 2.5 refuses "
            "with 'Duplicate GPU detected'): an engine that shares the trainer's GPU takes its "
            "weights by CUDA IPC (ipc_handles / open_ipc_handles), not by this broadcast group")


def _make_group(store: PrefixStore, rank: int, world_size: int, backend: str, dev: torch.device,
                timeout: timedelta) -> ProcessGroup:
    """An unregistered ProcessGroup with one backend, as ``torch.distributed._dist2`` builds them."""
    pg = ProcessGroup(store, rank, world_size)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        gloo = ProcessGroupGloo(store, rank, world_size, timeout)
        gloo._set_sequence_number_for_group()
        pg._set_default_backend(ProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)
        if torch.cuda.is_available():
            pg._register_backend(torch.device("cuda"), ProcessGroup.BackendType.GLOO, gloo)
        return pg
    from torch.distributed import ProcessGroupNCCL  # only in CUDA builds of torch

    opts = ProcessGroupNCCL.Options()
    opts._timeout = timeout
    nccl = ProcessGroupNCCL(store, rank, world_size, opts)
    nccl._set_sequence_number_for_group()
    # communicator now, not at the first send: errors (an unreachable peer) surface in join
    nccl.eager_connect_single_device(dev)
    pg._set_default_backend(ProcessGroup.BackendType.NCCL)
    pg._register_backend(dev, ProcessGroup.BackendType.NCCL, nccl)
    return pg


# ---------------------------------------------------------------------------------------------
# CUDA IPC


@dataclass(frozen=True)
class IpcPayload:
    """Handles to one export of weights in GPU memory; picklable (a Ray argument).

    ``metas`` and ``slots`` describe the tensors in order. ``flat``: the handles are ``uint8``
    buckets and each tensor is ``slots[i]`` of bucket ``slots[i].bucket``; else handle ``i`` is
    tensor ``i`` itself (any strides). ``gpu_uuid`` names the physical GPU the memory is on.

    The sending process must keep this object alive until every receiver's
    :func:`open_ipc_handles` has returned and the receiver has dropped what it returned (it holds
    the exported buffers in ``keepalive``, which does not travel).
    """

    gpu_uuid: str
    metas: tuple[TensorMeta, ...]
    slots: tuple[Slot, ...]
    flat: bool
    handles: tuple[tuple[Callable[..., torch.Tensor], tuple[Any, ...]], ...]
    keepalive: tuple[torch.Tensor, ...] = field(default=(), repr=False, compare=False)

    def __reduce__(self) -> tuple[Any, ...]:
        return (IpcPayload, (self.gpu_uuid, self.metas, self.slots, self.flat, self.handles))


#: index of ``storage_device`` in the arguments of ``torch.multiprocessing.reductions.
#: rebuild_cuda_tensor`` (what ``reduce_tensor`` returns for a CUDA tensor)
_STORAGE_DEVICE_ARG = 6


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what}: CUDA IPC shares GPU memory between processes on one GPU and "
                           "needs CUDA (torch.cuda.is_available() is False here); use the broadcast "
                           "group (gloo on CPU) or the object store instead")


def ipc_handles(named: NamedTensors, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> IpcPayload:
    """Trainer side: export ``named`` (CUDA tensors, all on one GPU) as picklable IPC handles.

    ``bucket_bytes > 0``: the tensors' bytes are copied into ``uint8`` buckets (one handle each);
    ``bucket_bytes == 0``: one handle per tensor, no copy (the receiver sees the tensor's own
    memory, strides included). Raises ``RuntimeError`` without CUDA, ``ValueError`` for a CPU
    tensor or tensors on several GPUs.
    """
    _require_cuda("ipc_handles")
    from torch.multiprocessing.reductions import reduce_tensor

    items = list(named)
    _check_named(items)
    devices = {t.device for _, t in items}
    cpu = [name for name, t in items if t.device.type != "cuda"]
    if cpu:
        raise ValueError(f"CUDA IPC exports GPU memory; these weights are not on a GPU: {cpu[:5]}")
    if len(devices) > 1:
        raise ValueError(f"the weights are on several GPUs ({sorted(map(str, devices))}); export "
                         "each GPU's weights separately")
    if not items:
        return IpcPayload("", (), (), bucket_bytes > 0, ())
    device = next(iter(devices))
    metas = weight_metas(items)
    if bucket_bytes > 0:
        slots, sizes = plan_buckets(metas, bucket_bytes)
        bufs = []
        with torch.no_grad():
            for b, size in enumerate(sizes):
                idx = [i for i, s in enumerate(slots) if s.bucket == b]
                buf = torch.empty(size, dtype=torch.uint8, device=device)
                for i in idx:
                    s = slots[i]
                    buf[s.offset: s.offset + s.nbytes].copy_(_as_bytes(items[i][1]))
                bufs.append(buf)
        keep = tuple(bufs)
    else:
        slots = [Slot(i, 0, m.nbytes) for i, m in enumerate(metas)]
        keep = tuple(t.detach() for _, t in items)
    # the copies (and the trainer's pending writes to its weights) must be done before a
    # receiver on another stream reads them; reduce_tensor also records an event for this
    torch.cuda.current_stream(device).synchronize()
    handles = tuple(reduce_tensor(t) for t in keep)
    return IpcPayload(gpu_uuid(device), tuple(metas), tuple(slots), bucket_bytes > 0, handles, keep)


def open_ipc_handles(payload: IpcPayload, device: torch.device | int | None = None,
                     ) -> list[tuple[str, torch.Tensor]]:
    """Engine side: the exported tensors, mapped (not copied) into this process on ``device``.

    ``device``: this process's index of the sender's physical GPU (default: found by its UUID
    among the visible devices; a given device on another GPU raises ``ValueError``). Copy the
    tensors into the engine's own weights (``param.copy_(t)``), then drop them and tell the
    sender it may drop its payload. Raises ``RuntimeError`` without CUDA.
    """
    _require_cuda("open_ipc_handles")
    if not payload.handles:
        return []
    if device is None:
        index = _local_index(payload.gpu_uuid)
    else:
        index = device.index if isinstance(device, torch.device) else device
        if index is None:
            index = torch.cuda.current_device()
        if gpu_uuid(index) != payload.gpu_uuid:
            raise ValueError(f"cuda:{index} is GPU {gpu_uuid(index)}, but the handles are to memory "
                             f"on GPU {payload.gpu_uuid}: CUDA IPC needs the same physical GPU")
    opened = []
    for rebuild, args in payload.handles:
        a = list(args)
        a[_STORAGE_DEVICE_ARG] = index  # the sender's numbering may differ (CUDA_VISIBLE_DEVICES)
        opened.append(rebuild(*a))
    if not payload.flat:
        return [(m.name, t) for m, t in zip(payload.metas, opened)]
    return [(m.name, _from_bytes(opened[s.bucket], s, m)) for m, s in zip(payload.metas, payload.slots)]


def _local_index(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == uuid:
            return i
    raise ValueError(f"GPU {uuid} (where the handles point) is not visible to this process "
                     f"(CUDA_VISIBLE_DEVICES): CUDA IPC needs the same physical GPU")
