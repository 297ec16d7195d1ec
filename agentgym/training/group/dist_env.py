"""Process-group plumbing shared by the in-process trainer and the resident group's launcher:
free ports, the one-rank process group DeepSpeed wants (set up without compiling DeepSpeed's
CPU shared-memory comm op: ``agentgym.patches.deepspeed.skip_shm_comm_build``), and the
environment handed to ranks."""

from __future__ import annotations

import os
import socket

import torch

import agentgym
from agentgym.patches.deepspeed import skip_shm_comm_build

# Set by a launcher for its ranks; the driver's own one-rank group must not leak them into children.
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (another process may still take it before it is bound)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_single_process_dist() -> None:
    """DeepSpeed wants a process group even for one rank; set one up on loopback.

    A launcher (torchrun, deepspeed) sets MASTER_ADDR/PORT and the ranks; alone, a free port is
    chosen for this process only: MASTER_PORT is removed again after the group exists, or every
    child process (a Prefect worker's flow runs, torchrun's ranks) would inherit the same port
    and fail to bind it. RANK/LOCAL_RANK/WORLD_SIZE stay: DeepSpeed reads LOCAL_RANK later.
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
            deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    finally:
        if own_port:
            os.environ.pop("MASTER_PORT", None)


def rank_env(threads_per_rank: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a launcher and its ranks: this package importable, the cores split
    between ranks, and none of this process's own rank variables."""
    env = dict(os.environ)
    pkg_root = str(agentgym.PACKAGE_ROOT)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = str(threads_per_rank)
    env["AGENTGYM_THREADS"] = str(threads_per_rank)
    env.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    for k in RANK_VARS:
        env.pop(k, None)
    env.update(extra or {})
    return env
