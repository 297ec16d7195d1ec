"""Full weights from training rank 0 to every rollout worker, over the channel ``ray.weight_sync``
names.

* ``object_store``: rank 0 puts its weights in Ray's object store once; every worker fetches
  them from its node's store (one copy per node) and loads them. Works everywhere (CPU, GPU,
  across nodes); the cost is one serialization and a copy per node.
* ``broadcast``: rank 0 and the workers form a process group of their own
  (``weight_channel.BroadcastGroup``: NCCL on GPUs, gloo on CPUs) and rank 0 broadcasts byte
  buckets of the weights, as OpenRLHF's ``_broadcast_to_vllm``. The group is formed at the first
  sync and again after a worker was re-created (a group with a dead member cannot be reused);
  the re-created worker itself gets the current weights through the object store at once, since
  the others are busy playing and cannot join a new group mid-rollout.
* ``cuda_ipc``: trainer and engines share one GPU; rank 0 exports CUDA IPC handles of its
  weights and each worker maps and copies them (no transfer). GPU only.

Each returns ``time/weight_sync_s`` (the whole sync, as the flow waits for it).
"""

from __future__ import annotations

import time
from typing import Any

import ray

from agentgym.cluster.rollout_pool import RolloutPool
from agentgym.cluster.trainer_group import RayTrainerGroup


class WeightSync:
    """The session's weight sync under Ray: remembers the broadcast group's members."""

    def __init__(self, mode: str, timeout_s: float = 300.0):
        self.mode = mode
        self.timeout_s = timeout_s
        self._formed_with: tuple[Any, ...] | None = None  # the actors the broadcast group holds
        self._metas: Any = None

    def __call__(self, trainer: RayTrainerGroup, pool: RolloutPool, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        pool.weights_source = trainer.weights_ref  # a re-created worker's weights, any channel
        if self.mode == "object_store":
            out = pool.sync(trainer.weights_ref(), version)
        elif self.mode == "broadcast":
            out = self._broadcast(trainer, pool, version)
        elif self.mode == "cuda_ipc":
            payload = trainer.ranks[0].ipc_export.remote()
            others = [a.ipc_export.remote() for a in trainer.ranks[1:]]
            loads = pool.each(lambda i, w: w.load_ipc.remote(payload, version), "CUDA IPC weight sync")
            ray.get(others)
            pool.mark_synced(version)
            out = {"time/weight_load_max_s": max(loads, default=0.0)}
        else:
            raise ValueError(f"ray.weight_sync={self.mode!r}: use object_store, broadcast or cuda_ipc")
        return {**out, "time/weight_sync_s": time.perf_counter() - t0}

    def _broadcast(self, trainer: RayTrainerGroup, pool: RolloutPool, version: int) -> dict[str, float]:
        members = (trainer.ranks[0], *pool.workers)
        if self._formed_with != members or pool.members_changed:
            self._form(trainer, pool)
        sends = [a.channel_send.remote() for a in trainer.ranks]
        loads = [w.channel_receive.remote(self._metas, version) for w in pool.workers]
        try:
            got = ray.get(loads + sends)
        except ray.exceptions.RayActorError:
            self._formed_with = None  # a member died mid-broadcast: re-form at the next sync
            raise
        pool.mark_synced(version)
        return {"time/weight_load_max_s": max(got[:len(loads)], default=0.0)}

    def _form(self, trainer: RayTrainerGroup, pool: RolloutPool) -> None:
        """(Re-)form the broadcast group: trainer rank 0 and every worker, on a fresh port."""
        ranks, workers = trainer.ranks, pool.workers
        gpu = bool(trainer.placement and trainer.placement[0].get("gpus")) and pool.cfg.ray.gpus_per_worker > 0
        backend = "nccl" if gpu else "gloo"
        host, port = ray.get(ranks[0].rendezvous.remote())
        world = 1 + len(workers)
        joins = [ranks[0].channel_join.remote(host, port, world, backend, self.timeout_s)]
        joins += [w.channel_join.remote(host, port, 1 + i, world, backend, self.timeout_s)
                  for i, w in enumerate(workers)]
        metas = [a.channel_metas.remote() for a in ranks]
        ray.get(joins)
        self._metas = ray.get(metas)[0]
        self._formed_with = (ranks[0], *workers)
        pool.members_changed = False

    def close(self) -> None:
        """Leave the broadcast group (best effort: the actors may be gone)."""
        if self._formed_with is None:
            return
        calls = [a.channel_close.remote() for a in self._formed_with]
        try:
            ray.get(calls, timeout=30)
        except Exception:  # noqa: BLE001 - closing after a failure
            pass
        self._formed_with = None
