"""Rollouts over N workers: Ray actors, each with its own engine and environments.

The flow's process stays the single controller. ``RolloutPool.collect`` splits an iteration's
episodes by GRPO group (a group's episodes stay on one worker, so its members batch together
as they would in one process), every worker plays its share and stages its shards in the
trajectory store (``EpisodeWriter.hand_off``), and only when every worker has returned does
the driver adopt the shards and commit the iteration once. The store's commit protocol, Parquet
layout and resume rules are those of a one-process rollout.

Sampling is seeded per (episode, turn) (``rollout.sampling_seeds``), so which worker plays an
episode, and beside which others, does not change its replies: N workers play the episodes one
worker would (tests/cluster/test_rollout_pool.py).

Weights: ``sync`` hands every worker the same object ref (rank 0's weights in Ray's object
store; one copy per node); each worker loads it into its engine. The pool keeps the last ref
and its policy version, so a worker that is re-created after a crash gets the current weights
before it plays.

Faults: a worker that dies mid-share (``RayActorError``: its process killed, its node gone)
is re-created (``ray.max_actor_restarts`` times per call), resynced, and plays its share again
from the start; its shards staged before the crash are hidden files that no manifest lists and
that the iteration's commit removes. Nothing is committed until every share is in.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import ray
import torch

from agentgym.cluster.ray_runtime import ACTOR_ENV, ClusterError, actor_threads, ensure_ray
from agentgym.config import PipelineConfig
from agentgym.rollout.loop import EpisodeSpec, RolloutSettings
from agentgym.types import Episode

log = logging.getLogger(__name__)


class RolloutWorkerError(RuntimeError):
    """A rollout worker kept failing (more than ``ray.max_actor_restarts`` times in one call)."""


@ray.remote
class RolloutWorker:
    """One rollout worker: an inference engine and the environments its episodes play in."""

    def __init__(self, config: dict[str, Any], weights: str, index: int, threads: int):
        from agentgym.chat import ChatFormatter
        from agentgym.rollout.engines import engine_for

        torch.set_num_threads(threads)
        self.cfg = PipelineConfig.model_validate(config)
        self.index = index
        self.engine, tokenizer = engine_for(self.cfg, weights)
        self.formatter = ChatFormatter(tokenizer, self.cfg.rollout.response_prefix)
        self.version = 0

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(), "index": self.index,
                "version": self.version}

    def update_weights(self, weights: dict[str, torch.Tensor], version: int) -> float:
        """Load the full weights (Ray resolved the object ref into this process)."""
        t0 = time.perf_counter()
        self.engine.update_weights(weights.items())
        self.version = version
        return time.perf_counter() - t0

    def channel_join(self, host: str, port: int, rank: int, world_size: int, backend: str,
                     timeout_s: float) -> None:
        """Join the weight channel's broadcast group as receiver ``rank`` (1..)."""
        from agentgym.cluster.weight_channel import BroadcastGroup

        self.channel_close()
        self.channel: BroadcastGroup | None = BroadcastGroup.join(host, port, rank, world_size, backend, timeout_s)

    def channel_receive(self, metas: Any, version: int) -> float:
        """Receive one broadcast of the weights (``metas``: rank 0's) and load it."""
        t0 = time.perf_counter()
        assert self.channel is not None, "channel_join first"
        self.engine.update_weights(self.channel.receive(metas))
        self.version = version
        return time.perf_counter() - t0

    def channel_close(self) -> None:
        old = getattr(self, "channel", None)
        self.channel = None
        if old is not None:
            old.close()

    def load_ipc(self, payload: Any, version: int) -> float:
        """Load the weights behind CUDA IPC handles (trainer rank 0 on this GPU) into the engine."""
        from agentgym.cluster.weight_channel import open_ipc_handles

        t0 = time.perf_counter()
        self.engine.update_weights(open_ipc_handles(payload))
        torch.cuda.synchronize()
        self.version = version
        return time.perf_counter() - t0

    def collect(self, specs: list[EpisodeSpec], settings: RolloutSettings, store: dict[str, Any],
                where: dict[str, Any]) -> dict[str, Any]:
        """Play ``specs`` and stage their shards in ``store`` for iteration ``where`` (stage,
        iteration, global_step, policy_version, created_at, chunk_episodes); returns the staged
        shards (the driver commits them), one summary per episode and the engine's counters."""
        from agentgym.pipeline import EpisodeSummary
        from agentgym.rollout.loop import iter_episodes
        from agentgym.store.trajectory_store import TrajectoryStore
        from env_adapters import make_env

        st = TrajectoryStore(**store)
        t0 = time.perf_counter()
        tokens0, gen0 = self.engine.generated_tokens, self.engine.generate_seconds
        writer = st.episode_writer(stage=where["stage"], iteration=where["iteration"],
                                   global_step=where["global_step"], policy_version=self.version,
                                   chunk_episodes=where["chunk_episodes"])
        writer.created_at = where["created_at"]
        summaries, store_s = [], 0.0
        with writer:
            for ep in iter_episodes(self.engine, self.formatter, specs, settings, make_env=make_env):
                t_add = time.perf_counter()
                writer.add(ep)
                store_s += time.perf_counter() - t_add
                summaries.append(EpisodeSummary.of(ep))
            staged = writer.hand_off()
        return {"staged": staged, "summaries": summaries, "episode_ids": [s.episode_id for s in summaries],
                "generated_tokens": self.engine.generated_tokens - tokens0,
                "generate_s": self.engine.generate_seconds - gen0, "store_s": store_s,
                "seconds": time.perf_counter() - t0, "version": self.version}

    def digest(self) -> str:
        """``weights_digest`` of the weights the engine serves (engines holding a torch model:
        hf); tests compare it with the trainer's."""
        from agentgym.cluster.digest import weights_digest

        model = getattr(self.engine, "model", None)
        if model is None:
            raise NotImplementedError(f"{type(self.engine).__name__} exposes no torch model to digest")
        return weights_digest(model.named_parameters())

    def play(self, specs: list[EpisodeSpec], settings: RolloutSettings) -> list[Episode]:
        """Play ``specs`` and return the episodes (held-out evaluation: nothing is stored)."""
        from agentgym.rollout.loop import run_episodes
        from env_adapters import make_env

        return run_episodes(self.engine, self.formatter, specs, settings, make_env=make_env)

    def close(self) -> None:
        self.engine.close()


def split_by_group(specs: Sequence[EpisodeSpec], n: int) -> list[list[EpisodeSpec]]:
    """``specs`` in ``n`` shares of whole groups (in order; sizes differ by at most one group),
    so a group's episodes stay together. Fewer groups than ``n`` leave shares empty."""
    groups: dict[str, list[EpisodeSpec]] = {}
    for s in specs:
        groups.setdefault(s.group_id, []).append(s)
    ordered = list(groups.values())
    shares: list[list[EpisodeSpec]] = [[] for _ in range(n)]
    base, extra = divmod(len(ordered), n)
    k = 0
    for i in range(n):
        take = base + (1 if i < extra else 0)
        for g in ordered[k:k + take]:
            shares[i].extend(g)
        k += take
    return shares


class RolloutPool:
    """``rollout.workers`` rollout workers; the driver's side."""

    def __init__(self, cfg: PipelineConfig, weights: str, size: int | None = None):
        ensure_ray(cfg.ray)
        self.cfg = cfg
        self.size = size or cfg.rollout.workers
        self.weights_path = str(weights)
        self.version = 0
        self._weights_ref: Any = None  # the weights the workers hold (a re-created one gets them)
        # where a re-created worker gets the weights when no object ref is kept (the broadcast
        # and CUDA IPC channels): a callable returning an object ref to them (the trainer's)
        self.weights_source: Any = None
        self.members_changed = False  # a worker was re-created: a broadcast group must re-form
        self.restarts = 0
        self.timings: dict[str, float] = {}
        t0 = time.perf_counter()
        self._workers: list[Any] = [self._new_worker(i) for i in range(self.size)]
        self.infos = self._wait_ready(self._workers, "start")
        self.timings["start_s"] = time.perf_counter() - t0

    # -- workers -----------------------------------------------------------------------------
    def _new_worker(self, index: int) -> Any:
        r = self.cfg.ray
        threads = actor_threads(r.cpus_per_worker)
        return RolloutWorker.options(  # type: ignore[attr-defined]
            num_cpus=r.cpus_per_worker, num_gpus=r.gpus_per_worker, resources=dict(r.worker_resources),
            max_restarts=0,
            runtime_env={"env_vars": {**ACTOR_ENV, "OMP_NUM_THREADS": str(threads)}},
        ).remote(self.cfg.model_dump(mode="json"), self.weights_path, index, threads)

    def _wait_ready(self, workers: list[Any], what: str) -> list[dict[str, Any]]:
        refs = [w.info.remote() for w in workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.cfg.ray.placement_timeout_s)
        if len(ready) < len(refs):
            raise ClusterError(
                f"rollout workers ({what}): {len(refs) - len(ready)} of {len(refs)} were not placed within "
                f"{self.cfg.ray.placement_timeout_s:.0f} s (ray.placement_timeout_s); each asks for "
                f"{self.cfg.ray.cpus_per_worker} CPU and {self.cfg.ray.gpus_per_worker} GPU, the cluster offers "
                f"{ray.cluster_resources()}. Join a node, or lower rollout.workers / ray.cpus_per_worker")
        return ray.get(refs)

    def _replace(self, index: int) -> None:
        """Re-create worker ``index`` (its actor died) and give it the current weights."""
        try:
            ray.kill(self._workers[index])
        except Exception:  # noqa: BLE001 - already gone
            pass
        worker = self._new_worker(index)
        self._wait_ready([worker], f"re-creating worker {index}")
        ref = self._weights_ref
        if ref is None and self.weights_source is not None and self.version > 0:
            ref = self.weights_source()  # through the object store, whatever the channel
        if ref is not None:
            ray.get(worker.update_weights.remote(ref, self.version))
        self._workers[index] = worker
        self.members_changed = True
        self.restarts += 1
        log.warning("rollout worker %d re-created and resynced to policy version %d", index, self.version)

    @property
    def workers(self) -> list[Any]:
        """The worker actors (index order), for the weight channel's calls."""
        return list(self._workers)

    def each(self, call: Any, what: str) -> list[Any]:
        """``call(index, worker)`` -> object ref, on every worker; the answers in index order
        (a dead worker is re-created and asked again)."""
        return self._each(call, what)

    def mark_synced(self, version: int) -> None:
        """Record that every worker now holds policy ``version`` (synced over a channel that
        keeps no object ref)."""
        self._weights_ref, self.version = None, version

    @property
    def pids(self) -> list[int]:
        return [int(i["pid"]) for i in ray.get([w.info.remote() for w in self._workers])]

    # -- weights -----------------------------------------------------------------------------
    def sync(self, weights: Any, version: int) -> dict[str, float]:
        """Every worker loads ``weights`` (an object ref to a name -> tensor dict, or the dict
        itself, put once); returns the seconds taken in all and the slowest worker's load."""
        t0 = time.perf_counter()
        ref = weights if isinstance(weights, ray.ObjectRef) else ray.put(weights)
        loads = self._each(lambda i, w: w.update_weights.remote(ref, version), "weight sync")
        self._weights_ref, self.version = ref, version
        return {"time/weight_sync_s": time.perf_counter() - t0,
                "time/weight_load_max_s": max(loads) if loads else 0.0}

    def _each(self, call: Any, what: str) -> list[Any]:
        """``call(index, worker)`` on every worker; a dead worker is re-created and the call
        repeated on it (at most ``ray.max_actor_restarts`` times in all)."""
        pending = {i: call(i, w) for i, w in enumerate(self._workers)}
        out: dict[int, Any] = {}
        failures = 0
        while pending:
            ready, _ = ray.wait(list(pending.values()), num_returns=1)
            i = next(k for k, ref in pending.items() if ref == ready[0])
            try:
                out[i] = ray.get(pending.pop(i))
            except ray.exceptions.RayActorError as e:
                failures += 1
                if failures > self.cfg.ray.max_actor_restarts:
                    self._abandon(pending)
                    self._replace(i)  # so that the next call (the task's retry) starts with live workers
                    raise RolloutWorkerError(
                        f"{what}: rollout worker {i} died again ({failures} failures in one call, "
                        f"ray.max_actor_restarts={self.cfg.ray.max_actor_restarts}): {str(e).splitlines()[0]}"
                    ) from None
                log.warning("%s: rollout worker %d died (%s); re-creating it", what, i,
                            str(e).splitlines()[0] if str(e) else type(e).__name__)
                self._replace(i)
                pending[i] = call(i, self._workers[i])
        return [out[i] for i in range(len(self._workers))]

    def _abandon(self, pending: dict[int, Any]) -> None:
        """Cancel the calls still running (a failed rollout: their shares will not be committed)."""
        for ref in pending.values():
            try:
                ray.cancel(ref)
            except Exception:  # noqa: BLE001 - already finished or gone
                pass

    # -- rollouts ----------------------------------------------------------------------------
    def collect(self, specs: list[EpisodeSpec], settings: RolloutSettings, store: dict[str, Any],
                where: dict[str, Any]) -> list[dict[str, Any]]:
        """Every worker plays its share of ``specs`` (``split_by_group``) and stages it; returns
        each share's result (``RolloutWorker.collect``) once all are in, for the driver to adopt
        and commit."""
        shares = split_by_group(specs, len(self._workers))
        results = self._each(lambda i, w: w.collect.remote(shares[i], settings, store, where), "rollout")
        return [r for r, share in zip(results, shares) if share or r["episode_ids"]]

    def play(self, specs: list[EpisodeSpec], settings: RolloutSettings) -> list[Episode]:
        """The episodes of ``specs`` played over the workers, in spec order (evaluation)."""
        shares = split_by_group(specs, len(self._workers))
        got = self._each(lambda i, w: w.play.remote(shares[i], settings), "evaluation")
        by_id = {e.episode_id: e for eps in got for e in eps}
        return [by_id[s.episode_id] for s in specs]

    def close(self) -> None:
        for w in self._workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - the cluster may be gone at exit
                pass
        self._workers = []
