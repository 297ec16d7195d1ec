"""Process-group plumbing for the trainer: free ports, and the process group DeepSpeed wants
(one rank in the flow's process, or a Ray rank actor's share of a group), set up without
compiling DeepSpeed's CPU shared-memory comm op (``agentgym.patches.deepspeed.skip_shm_comm_build``)."""

from __future__ import annotations

import os
import socket

import torch

from agentgym.patches.deepspeed import skip_shm_comm_build


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (another process may still take it before it is bound)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_single_process_dist() -> None:
    """DeepSpeed wants a process group even for one rank; set one up on loopback.

    A Ray rank actor (``agentgym.cluster.trainer_group``) sets MASTER_ADDR/PORT and the ranks;
    alone, the group rendezvouses in memory (no socket listens), and a free port is named only
    because DeepSpeed looks for MASTER_PORT before adopting the group: it is removed again after the
    group exists, or every child process (a Prefect worker's flow runs) would inherit the same
    port and fail to bind it. RANK/LOCAL_RANK/WORLD_SIZE stay: DeepSpeed reads LOCAL_RANK later.
    """
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    own_port = "MASTER_PORT" not in os.environ
    if own_port and not torch.distributed.is_initialized():
        os.environ["MASTER_PORT"] = str(free_port())
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    import deepspeed

    skip_shm_comm_build()
    try:
        if not torch.distributed.is_initialized():
            backend = "gloo" if not torch.cuda.is_available() else "nccl"
            if own_port:
                # Alone, the rendezvous needs no socket: an in-memory store, which DeepSpeed adopts
                # below. (env:// would start a TCPStore server, and it listens on every interface
                # whatever MASTER_ADDR says.)
                torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(),
                                                     rank=0, world_size=1)
            deepspeed.init_distributed(dist_backend=backend)
    finally:
        if own_port:
            os.environ.pop("MASTER_PORT", None)
