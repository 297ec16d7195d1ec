"""Connecting this process to Ray: an embedded cluster on loopback, or an existing one.

``ray.address`` (``RayConfig``): ``null`` / ``local`` start an embedded single-node cluster
pinned to 127.0.0.1; ``auto``, ``host:port`` or ``ray://host:port`` attach to a cluster that
other nodes joined with ``ray start --address=...``. A process already connected (a test's
shared cluster, a user's own ``ray.init``) is reused as it is.

Why loopback needs a switch: Ray replaces 127.0.0.1 with the machine's interface address
(``ray._private.services.resolve_ip_for_localhost``) and binds its servers to every interface,
unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` marks the node as one that never joins a cluster;
then the GCS, raylet, object store and workers advertise and bind 127.0.0.1 only (checked with
``ss -ltn`` on Ray 2.60). An embedded cluster sets it; attaching to a real cluster must not.

Ray is imported here and in the actor modules only, never on the single-process path.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from agentgym.config import RayConfig

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
#: Ray's switch that keeps a node on loopback (see the module docstring)
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
#: environment every actor gets: no tokenizer thread pools fighting the engine's threads, and the
#: DeepSpeed accelerator chosen as in the flow's process
ACTOR_ENV = {"TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0"}


class ClusterError(RuntimeError):
    """The Ray cluster cannot place what the run asks for (or cannot be reached)."""


def embedded(cfg: RayConfig) -> bool:
    """Whether ``cfg`` asks for a cluster started by this process (``null`` or ``local``)."""
    return cfg.address in (None, "local")


def pin_to_loopback() -> None:
    """Keep the Ray node this process starts (and its workers) on 127.0.0.1: the environment
    switch for the processes it spawns, and Ray's constant, read when it resolves the node's
    address, for this one (it was fixed when ``ray`` was first imported)."""
    import ray._private.ray_constants as ray_constants

    os.environ[LOOPBACK_ONLY_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def ensure_ray(cfg: RayConfig) -> dict[str, Any]:
    """Connect this process to the cluster ``cfg`` names, unless it is connected already.

    Returns what was done, for the run's log: ``{"started": bool, "address", "seconds",
    "cpus", "gpus", "nodes"}``.
    """
    import ray

    t0 = time.perf_counter()
    started = False
    if not ray.is_initialized():
        common: dict[str, Any] = dict(
            include_dashboard=False, log_to_driver=True, configure_logging=False,
            runtime_env={"env_vars": dict(ACTOR_ENV)},
        )
        if embedded(cfg):
            pin_to_loopback()
            # address="local", not None: None joins the cluster recorded in /tmp/ray/ray_current_cluster
            # (a `ray start` or a test's ray.cluster_utils.Cluster on this host) if there is one
            ray.init(address="local", num_cpus=cfg.num_cpus or os.cpu_count() or 1, _node_ip_address=LOOPBACK,
                     **common)
        else:
            try:
                ray.init(address=cfg.address, **common)
            except (ConnectionError, RuntimeError) as e:
                raise ClusterError(
                    f"ray.address={cfg.address!r}: cannot connect ({e}). Start the head node with "
                    "`ray start --head --port=6379` and give its host:port (or ray://host:10001 for "
                    "Ray Client); null runs an embedded cluster on this host") from None
        started = True
    res = ray.cluster_resources()
    info = {"started": started, "address": cfg.address or "local", "seconds": time.perf_counter() - t0,
            "cpus": float(res.get("CPU", 0.0)), "gpus": float(res.get("GPU", 0.0)),
            "nodes": len([n for n in ray.nodes() if n.get("Alive")])}
    if started:
        log.info("ray: connected to %s in %.1f s (%d nodes, %.0f CPUs, %.0f GPUs)", info["address"],
                 info["seconds"], info["nodes"], info["cpus"], info["gpus"])
    return info


def wait_placement(pg: Any, what: str, bundles: list[dict[str, float]], timeout_s: float) -> None:
    """Wait until placement group ``pg`` is placed, else raise ``ClusterError`` naming the
    bundles it needs against what the cluster offers."""
    import ray

    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        offered = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU", "memory")
                   or k.startswith("agentgym")}
        raise ClusterError(
            f"{what}: the cluster did not place {len(bundles)} bundle(s) {bundles} within "
            f"{timeout_s:.0f} s (ray.placement_timeout_s); it offers {offered}. Join a node with the "
            "resources (`ray start --address=HEAD:PORT`), lower trainer.world_size / rollout.workers, "
            "or ask for fewer CPUs (ray.cpus_per_rank, ray.cpus_per_worker)") from None


def actor_threads(num_cpus: float) -> int:
    """Torch threads for an actor given ``num_cpus``: at least one, whole CPUs."""
    return max(1, int(num_cpus))
