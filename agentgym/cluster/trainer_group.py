"""Training at world size N > 1: N DeepSpeed ranks as Ray actors, driven by the flow's process.

``RayTrainerGroup`` implements ``agentgym.training.protocol.Trainer`` like ``PolicyTrainer``;
the pipeline never asks which one it holds. As OpenRLHF's launcher does
(``openrlhf/trainer/ray/launcher.py``), the ranks are placed in one placement group (a bundle
per rank: a GPU and ``ray.cpus_per_rank`` CPUs, or CPUs alone on a CPU cluster); rank 0 names a
rendezvous address (its node's IP and a free port there); every actor sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT and then builds its ``PolicyTrainer``, whose
``deepspeed.initialize`` joins the group. Weights and optimizer state stay in the actors
between iterations.

Every call goes to every rank (the update's all-reduces and ZeRO-3's gathers are collectives)
and answers with rank 0's result. Batches never cross Ray: ``train_from_store`` names the
iteration, and each rank reads it from the trajectory store. The weights go out through Ray's
object store (``weights_ref``): rank 0 puts one copy, and rollout workers on every node fetch
it from there, so the full weights never pass through the driver.

Failures: an actor that dies (its process killed, its node lost) or a rank that raises takes
the group down. The call raises ``GroupError`` naming the rank and the cause; later calls raise
it again until ``restart()``, which places a new group and reloads the last checkpoint this
group saved or loaded (the pipeline instead drops the session and resumes from the run's
latest MLflow checkpoint: ``tasks.rl.update_policy``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from agentgym.cluster.ray_runtime import ACTOR_ENV, actor_threads, ensure_ray, wait_placement
from agentgym.config import AlgorithmConfig, RayConfig, TrainerConfig
from agentgym.training.batch import TrainBatch
from agentgym.training.protocol import GroupError

log = logging.getLogger(__name__)


@ray.remote
class TrainerRank:
    """One DeepSpeed rank: a ``PolicyTrainer`` inside a Ray actor."""

    def __init__(self, rank: int, world_size: int, threads: int):
        self.rank, self.world_size = rank, world_size
        torch.set_num_threads(threads)
        self.trainer: Any = None

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's node address and a port free there: the group's MASTER_ADDR / PORT."""
        from agentgym.training.dist_env import free_port

        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def setup(self, master: tuple[str, int], init: dict[str, Any]) -> dict[str, Any]:
        """Join the process group and build the trainer (one read of the weights)."""
        from types import SimpleNamespace

        from agentgym.training.policy_trainer import PolicyTrainer

        gpus = ray.get_gpu_ids()
        os.environ.update({
            "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]), "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            # Ray sets CUDA_VISIBLE_DEVICES to the bundle's GPU: it is device 0 in this process
            "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        })
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if gpus else "cpu")
        self.trainer = PolicyTrainer(
            init["model_path"], SimpleNamespace(pad_token_id=init["pad_id"]),
            TrainerConfig.model_validate(init["trainer"]), AlgorithmConfig.model_validate(init["algorithm"]),
            temperature=init["temperature"], seed=init["seed"],
            action_temperature=init["action_temperature"])
        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(), "gpus": gpus}

    def call(self, method: str, *args: Any, **kwargs: Any) -> tuple[Any, int] | None:
        """``PolicyTrainer.method(*args, **kwargs)``; rank 0's answer is the group's, with its
        optimizer step count after the call."""
        out = getattr(self.trainer, method)(*args, **kwargs)
        return (out, int(self.trainer.optimizer_steps)) if self.rank == 0 else None

    def weights(self) -> dict[str, torch.Tensor] | None:
        """The full policy weights (every rank iterates: ZeRO-3 gathers), returned by rank 0.
        Copies, contiguous: a view would ship its whole storage."""
        got = {n: t.detach().contiguous().clone() for n, t in self.trainer.named_weights()}
        return got if self.rank == 0 else None

    def digest(self) -> str:
        """``weights_digest`` of the policy (every rank iterates: ZeRO-3 gathers)."""
        from agentgym.cluster.digest import weights_digest

        return weights_digest(self.trainer.named_weights())

    def pid(self) -> int:
        return os.getpid()

    def save_hf_files(self) -> dict[str, bytes] | None:
        """Export the policy into a folder of this node and return its files (rank 0; every rank
        takes part: ZeRO-3 gathers): how an export reaches a driver on another node."""
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory(prefix="agentgym-export-") as d:
            self.trainer.save_hf(d, None)
            if self.rank != 0:
                return None
            return {str(p.relative_to(d)): p.read_bytes() for p in sorted(Path(d).rglob("*")) if p.is_file()}

    # -- the weight channel's GPU paths (agentgym.cluster.weight_sync drives them) -------------
    def channel_metas(self) -> Any:
        """Rank 0's ``weight_metas`` of the policy (every rank iterates: ZeRO-3 gathers)."""
        from agentgym.cluster.weight_channel import weight_metas

        metas = weight_metas(self.trainer.named_weights())
        return metas if self.rank == 0 else None

    def channel_join(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> None:
        """Rank 0 joins the broadcast group as its sender (rank 0); other ranks have no part."""
        from agentgym.cluster.weight_channel import BroadcastGroup

        self.channel_close()
        if self.rank == 0:
            self.channel: BroadcastGroup | None = BroadcastGroup.join(host, port, 0, world_size, backend, timeout_s)

    def channel_send(self) -> None:
        """One broadcast of the policy from rank 0 (the others iterate for ZeRO-3's gathers)."""
        named = self.trainer.named_weights()
        if self.rank == 0:
            assert self.channel is not None, "channel_join first"
            self.channel.send(named)
        else:
            for _ in named:
                pass

    def channel_close(self) -> None:
        old = getattr(self, "channel", None)
        self.channel = None
        if old is not None:
            old.close()

    def ipc_export(self) -> Any:
        """Rank 0: CUDA IPC handles of the policy's weights (kept alive here until the next
        export), for engines on the same GPU."""
        from agentgym.cluster.weight_channel import ipc_handles

        named = list(self.trainer.named_weights())
        if self.rank != 0:
            return None
        self._ipc = ipc_handles(named)
        return self._ipc


class RayTrainerGroup:
    """N training ranks as Ray actors; the driver's side (a ``Trainer``, like ``PolicyTrainer``)."""

    def __init__(self, model_path: str | Path, tokenizer: Any, trainer: TrainerConfig,
                 algorithm: AlgorithmConfig, temperature: float = 1.0, seed: int = 0,
                 ray_cfg: RayConfig | None = None, action_temperature: float = 1.0):
        self.ray_cfg = ray_cfg or RayConfig()
        ensure_ray(self.ray_cfg)
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.world_size = trainer.world_size
        self._init = {"model_path": str(model_path), "pad_id": self.pad_id,
                      "trainer": trainer.model_dump(mode="json"), "algorithm": algorithm.model_dump(mode="json"),
                      "temperature": float(temperature), "seed": int(seed),
                      "action_temperature": float(action_temperature)}
        self.optimizer_steps = 0
        self.last_checkpoint: Path | None = None
        self.restarts = 0
        self.timings: dict[str, float] = {}
        self._ranks: list[Any] = []
        self._pg: Any = None
        self._broken: GroupError | None = None
        self.placement: list[dict[str, Any]] = []
        self._start()

    # -- life cycle ------------------------------------------------------------------------
    def _bundles(self) -> list[dict[str, float]]:
        gpus = ray.cluster_resources().get("GPU", 0.0)
        bundle = {"CPU": self.ray_cfg.cpus_per_rank, **self.ray_cfg.rank_resources}
        if gpus >= self.world_size:
            bundle["GPU"] = 1.0
        return [dict(bundle) for _ in range(self.world_size)]

    def _start(self) -> None:
        t0 = time.perf_counter()
        bundles = self._bundles()
        self._pg = placement_group(bundles, strategy=self.ray_cfg.placement)
        wait_placement(self._pg, f"trainer.world_size={self.world_size}", bundles, self.ray_cfg.placement_timeout_s)
        threads = actor_threads(self.ray_cfg.cpus_per_rank)
        env = {**ACTOR_ENV, "OMP_NUM_THREADS": str(threads)}
        self._ranks = [
            TrainerRank.options(  # type: ignore[attr-defined]
                num_cpus=bundles[r]["CPU"], num_gpus=bundles[r].get("GPU", 0.0),
                resources={k: v for k, v in bundles[r].items() if k not in ("CPU", "GPU")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=r),
                runtime_env={"env_vars": env}, max_restarts=0,
            ).remote(r, self.world_size, threads)
            for r in range(self.world_size)
        ]
        self._broken = None
        master = self._get([self._ranks[0].rendezvous.remote()], "rendezvous")[0]
        self.placement = self._get([a.setup.remote(master, self._init) for a in self._ranks], "setup")
        self.timings["start_s"] = time.perf_counter() - t0
        log.info("training group: %d ranks on %d node(s) in %.1f s", self.world_size,
                 len({p["node"] for p in self.placement}), self.timings["start_s"])

    def _stop(self) -> None:
        for a in self._ranks:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._ranks = []
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001 - the cluster may be gone at exit
                pass
            self._pg = None

    def restart(self) -> dict[str, Any]:
        """Place a new group and reload the last checkpoint this group saved or loaded (if any)."""
        self._stop()
        self._start()
        self.restarts += 1
        state: dict[str, Any] = {}
        if self.last_checkpoint is not None:
            state = self.load_checkpoint(self.last_checkpoint)
        return state

    def close(self) -> None:
        """Kill the ranks and free their placement group; idempotent."""
        self._stop()

    @property
    def rank_pids(self) -> dict[int, int]:
        return {r: int(p["pid"]) for r, p in enumerate(self.placement)}

    @property
    def rank_nodes(self) -> dict[int, str]:
        return {r: str(p["node"]) for r, p in enumerate(self.placement)}

    # -- calls ------------------------------------------------------------------------------
    def _get(self, refs: list[Any], op: str) -> list[Any]:
        """Wait for every rank's answer; any failure takes the group down (``GroupError``)."""
        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            rank = next((r for r, a in enumerate(self._ranks) if _dead(a)), None)
            self._fail(op, f"rank {rank if rank is not None else '?'} died ({type(e).__name__}: "
                           f"{_first_line(e)})")
        except ray.exceptions.RayTaskError as e:
            self._fail(op, f"a rank raised:\n{e}")
        raise AssertionError("unreachable")

    def _fail(self, op: str, why: str) -> None:
        self._broken = GroupError(
            f"training group ({self.world_size} ranks) failed in {op}: {why}. The group is down; "
            "re-run the pipeline with the same run id to resume from its latest checkpoint "
            "(or call restart())")
        self._stop()
        raise self._broken

    def _all(self, op: str, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._broken is not None:
            raise self._broken
        out, self.optimizer_steps = self._get([a.call.remote(method, *args, **kwargs) for a in self._ranks], op)[0]
        return out

    def train_from_store(self, store: dict[str, Any], stage: int, iteration: int, seed: int = 0) -> dict[str, float]:
        return self._all("train_from_store", "train_from_store", store, stage, iteration, seed=seed)

    def train_on_batch(self, batch: TrainBatch, seed: int = 0, objective: str = "ppo",
                       epochs: int | None = None, mini_batches: int | None = None) -> dict[str, float]:
        ref = ray.put(batch)  # one copy per node for every rank, not one per call
        return self._all("train_on_batch", "train_on_batch", ref, seed=seed, objective=objective,
                         epochs=epochs, mini_batches=mini_batches)

    def compute(self, batch: TrainBatch, what: list[str] | tuple[str, ...]) -> dict[str, torch.Tensor]:
        return self._all("compute", "compute", ray.put(batch), list(what))

    def sft_metrics(self, batch: TrainBatch) -> dict[str, float]:
        return self._all("sft_metrics", "sft_metrics", ray.put(batch))

    def advance_lr_schedule(self, steps: int) -> None:
        self._all("advance_lr_schedule", "advance_lr_schedule", steps)

    def weights_ref(self) -> Any:
        """An object ref to rank 0's full weights (a ``dict[name, tensor]`` in Ray's object
        store): pass it to rollout workers, which fetch it from their node's store."""
        if self._broken is not None:
            raise self._broken
        refs = [a.weights.remote() for a in self._ranks]
        self._get(refs[1:], "weights")  # the other ranks only take part in the gathers
        try:
            ray.wait([refs[0]], fetch_local=False)
        except ray.exceptions.RayActorError as e:
            self._fail("weights", f"rank 0 died ({_first_line(e)})")
        return refs[0]

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights, fetched into this process (an in-process engine's sync)."""
        return iter(self._get([self.weights_ref()], "weights")[0].items())

    @property
    def ranks(self) -> list[Any]:
        """The rank actors (rank order), for the weight channel's calls."""
        if self._broken is not None:
            raise self._broken
        return list(self._ranks)

    def weight_digests(self) -> dict[int, str]:
        if self._broken is not None:
            raise self._broken
        return dict(enumerate(self._get([a.digest.remote() for a in self._ranks], "digest")))

    def save_adapter(self, out_dir: str | Path) -> Path:
        out = Path(out_dir).resolve()
        self._all("save_adapter", "save_adapter", str(out))
        return out

    def save_hf(self, out_dir: str | Path, tokenizer: Any = None) -> Path:
        """Export the policy as an HF folder in ``out_dir`` on this (the driver's) machine: rank 0
        writes it there when it runs on the driver's node, else it exports on its own node and the
        files come back through the object store (no shared filesystem needed)."""
        out = Path(out_dir).resolve()
        if self.rank_nodes.get(0) == ray.get_runtime_context().get_node_id():
            self._all("save_hf", "save_hf", str(out), None)
        else:
            if self._broken is not None:
                raise self._broken
            files = self._get([a.save_hf_files.remote() for a in self._ranks], "save_hf")[0]
            for rel, data in files.items():
                (out / rel).parent.mkdir(parents=True, exist_ok=True)
                (out / rel).write_bytes(data)
        (tokenizer or self.tokenizer).save_pretrained(out)
        return out

    def save_checkpoint(self, ckpt_dir: str | Path, client_state: dict[str, Any] | None = None) -> Path:
        ckpt = Path(ckpt_dir).resolve()
        self._all("save_checkpoint", "save_checkpoint", str(ckpt), dict(client_state or {}))
        self.last_checkpoint = ckpt
        return ckpt

    def load_checkpoint(self, ckpt_dir: str | Path) -> dict[str, Any]:
        ckpt = Path(ckpt_dir).resolve()
        if not (ckpt / "ds").is_dir():  # checked here: a rank's exception would take the group down
            raise FileNotFoundError(f"{ckpt} holds no trainer checkpoint (no ds/ folder)")
        state = self._all("load_checkpoint", "load_checkpoint", str(ckpt))
        self.last_checkpoint = ckpt
        return dict(state)

    def __enter__(self) -> RayTrainerGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _dead(actor: Any) -> bool:
    try:
        ray.get(actor.pid.remote(), timeout=5)
        return False
    except Exception:  # noqa: BLE001 - any failure to answer counts as dead
        return True


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
