"""Training at world size N > 1: a resident group of N DeepSpeed ranks; the driver's side.

``ResidentGroup`` implements ``agentgym.training.protocol.Trainer``, like ``PolicyTrainer``; a critic
(estimator gae) lives in the ranks beside the policy. It starts the ranks ONCE
(``launcher``: ``torchrun`` on this host; across hosts ``torchrun`` on every node with
``trainer.nnodes``, the other nodes joining with ``agentgym group join``, or, given a hostfile,
the ``deepspeed`` launcher over ssh). Each rank (``worker``) builds a ``PolicyTrainer`` (one read of the weights
from disk) and then serves commands, so weights and optimizer state stay in the ranks' memory
between iterations.

Channel (``rpc``): the driver listens on ``master_addr``; every rank connects with the
group's authkey and says hello with its rank and pid. A command goes to every rank; each rank
answers it. ``train_from_store`` (the pipeline's path) sends only a reference: every rank reads
the batch from the trajectory store. ``named_weights`` makes every rank iterate (ZeRO-3 gathers
are collectives) while rank 0 streams the tensors back.

Failures: a rank that dies (its connection closes or the launcher exits) or answers with an
exception takes the group down: the call raises ``GroupError`` naming the rank, its exit code
(from the launcher's report) and the tail of its log; later calls raise it again until
``restart()``, which relaunches the group and reloads the last checkpoint this group saved or
loaded. ``close()`` is idempotent, always ends the launcher's process tree and removes the
group's temporary folder (logs, torchrun's log folder), also after a failure; a ``run_dir``
given by the caller is kept.
"""

from __future__ import annotations

import atexit
import os
import logging
import secrets
import shutil
import subprocess
import time
import weakref
from pathlib import Path
from typing import Any, Iterator

import torch

from agentgym.config import AlgorithmConfig, TrainerConfig
from agentgym.infra import tempdirs
from agentgym.training.group.dist_env import free_port, rank_env
from agentgym.training.group.launcher import (
    describe_code,
    hostfile_slots,
    kill_tree,
    launcher_cmd,
    post_mortem,
    shared_authkey,
    write_ds_env_file,
)
from agentgym.training.batch import TrainBatch
from agentgym.training.group.rpc import AUTHKEY_ENV, Connection, RankAcceptor, recv, send, wait


log = logging.getLogger(__name__)


class GroupError(RuntimeError):
    """A rank of the resident training group died or failed; the group is down."""


_LIVE: "weakref.WeakSet[ResidentGroup]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for g in list(_LIVE):
        g.close()


class ResidentGroup:
    """N training ranks started once; the driver side (a ``Trainer``, like ``PolicyTrainer``)."""

    def __init__(
        self,
        model_path: str | Path,
        tokenizer,
        trainer: TrainerConfig,
        algorithm: AlgorithmConfig,
        temperature: float = 1.0,
        seed: int = 0,
        run_dir: str | Path | None = None,
        start_timeout_s: float = 900.0,
        command_timeout_s: float | None = None,
        threads_per_rank: int | None = None,
    ):
        if trainer.world_size < 2:
            raise ValueError("ResidentGroup is for world_size >= 2; use PolicyTrainer for 1")
        if trainer.hostfile is not None:
            slots = hostfile_slots(trainer.hostfile)
            if slots != trainer.world_size:
                raise ValueError(f"hostfile {trainer.hostfile} has {slots} slots but "
                                 f"trainer.world_size={trainer.world_size}; make them equal")
        if trainer.nnodes > 1:
            shared_authkey()  # every node needs the key: refuse before launching anything
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.cfg, self.algo = trainer, algorithm
        self.world_size = trainer.world_size
        self.start_timeout_s, self.command_timeout_s = start_timeout_s, command_timeout_s
        # A folder we make is ours to remove at close() (launcher and rank logs, the DeepSpeed
        # env file, torchrun's log folder); one the caller gives is theirs to keep.
        self._owns_run_dir = run_dir is None
        self.run_dir = Path(run_dir) if run_dir else tempdirs.make("agentgym-group-")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._init_args = {
            "model_path": str(model_path), "pad_id": self.pad_id,
            "trainer": trainer.model_dump(mode="json"), "algorithm": algorithm.model_dump(mode="json"),
            "temperature": float(temperature), "seed": int(seed),
        }
        cpus = os.cpu_count() or 1
        self.threads_per_rank = threads_per_rank or max(1, cpus // (self.world_size // trainer.nnodes))
        self.optimizer_steps = 0
        self.batch_bytes_sent = 0  # batch tensors sent over the sockets (train_from_store sends none)
        self.weight_loads_by_rank: dict[int, int] = {}
        self.restarts = 0
        self.last_checkpoint: Path | None = None
        self.timings: dict[str, float] = {}
        self.last_rank_seconds: dict[int, float] = {}  # time each rank spent on the last command
        self._conns: dict[int, Connection] = {}  # rank -> its connection
        self._pids: dict[int, int] = {}
        self._proc: subprocess.Popen | None = None
        self._error: str | None = None
        self._seq = 0
        self._attempt = 0
        self._launcher_log = self.log_dir / "launcher.log"
        _LIVE.add(self)
        self._start()

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def log_dir(self) -> Path:
        return self.run_dir / f"logs-{self._attempt}"

    @property
    def weight_loads(self) -> int:
        """Most reads of policy weights from disk by any rank since the group (re)started."""
        return max(self.weight_loads_by_rank.values(), default=0)

    @property
    def rank_pids(self) -> dict[int, int]:
        return dict(self._pids)

    def _start(self) -> None:
        t0 = time.perf_counter()
        self._attempt += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._error = None
        self._conns, self._pids = {}, {}
        self.weight_loads_by_rank = {}
        # one node: a fresh key per launch; several: the key every node was given beforehand
        authkey = shared_authkey() if self.cfg.nnodes > 1 else secrets.token_bytes(32)
        acceptor = RankAcceptor(self.cfg.master_addr, authkey, backlog=self.world_size,
                                port=self.cfg.driver_port or 0)
        env = rank_env(self.threads_per_rank, {AUTHKEY_ENV: authkey.hex()})
        if self.cfg.hostfile is not None:
            env["DS_ENV_FILE"] = str(write_ds_env_file(self.run_dir, env, secret_keys=(AUTHKEY_ENV,)))
        cmd = launcher_cmd(self.cfg, self.world_size, acceptor.address, self.cfg.master_port or free_port(),
                           self.log_dir)
        self._launcher_log = self.log_dir / "launcher.log"
        try:
            with open(self._launcher_log, "ab") as log:
                self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              env=env, start_new_session=True)
            deadline = time.monotonic() + self.start_timeout_s
            while len(self._conns) < self.world_size:
                if self._proc.poll() is not None:
                    self._fail("start", None, f"the launcher exited ({describe_code(self._proc.returncode)}) "
                               f"before all ranks connected")
                if time.monotonic() > deadline:
                    joins = ("" if self.cfg.nnodes == 1 else "; every other node must run `agentgym group "
                             "join --config ... --node-rank K` with the same AGENTGYM_GROUP_AUTHKEY")
                    self._fail("start", None, f"only ranks {sorted(self._conns)} connected within "
                               f"{self.start_timeout_s:.0f} s{joins}")
                got = acceptor.get(timeout=0.5)
                if got is not None:
                    hello, conn = got
                    self._conns[int(hello["rank"])] = conn
                    self._pids[int(hello["rank"])] = int(hello["pid"])
        finally:
            acceptor.close()  # every rank is in (or the start failed): no more connections
        self.timings["launch_s"] = time.perf_counter() - t0
        self._command("init", self._init_args, timeout=self.start_timeout_s)
        self.timings["start_s"] = time.perf_counter() - t0

    def close(self) -> None:
        """Stop the ranks (politely, then by signal to the launcher's process group) and remove
        the group's temporary folder (when no ``run_dir`` was given). Idempotent; also run at
        interpreter exit for groups never closed."""
        self._stop()
        if self._owns_run_dir and self.run_dir.exists():
            shutil.rmtree(self.run_dir, ignore_errors=True)
            if self.run_dir.exists():
                log.warning("could not remove the training group's folder %s", self.run_dir)

    def _stop(self) -> None:
        """Stop the ranks; the run folder stays (a ``restart`` starts its next attempt there)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            for conn in self._conns.values():
                try:
                    send(conn, {"op": "exit", "seq": -1})
                except OSError:
                    pass
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                kill_tree(proc)
        for conn in self._conns.values():
            conn.close()
        self._conns = {}
        if self._error is None:
            self._error = "the training group was closed"

    def restart(self) -> dict[str, Any]:
        """Relaunch the group (after a failure) and reload the last checkpoint it saved or
        loaded; returns that checkpoint's client_state ({} when there was none: the ranks then
        start again from the model folder)."""
        self._stop()
        self.restarts += 1
        self.optimizer_steps = 0
        self._start()
        if self.last_checkpoint is not None:
            return self.load_checkpoint(self.last_checkpoint)
        return {}

    def __enter__(self) -> "ResidentGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    # -- failure handling ------------------------------------------------------------------
    def _fail(self, op: str, rank: int | None, why: str, rank_error: str | None = None):
        """Take the group down and raise a GroupError that says what happened to whom."""
        proc = self._proc
        if rank_error is not None:
            self._stop()  # the ranks are alive: ask them to exit (a rank stuck in a collective is killed)
        elif proc is not None:
            try:  # the launcher notices a dead rank, ends the others and reports exit codes
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                kill_tree(proc)
        msg = post_mortem(op, rank, why, rank_error, self.world_size, self.log_dir, self._launcher_log)
        if self._owns_run_dir:
            msg += ("\n(the logs above are in a temporary folder removed when the group is closed; "
                    "give ResidentGroup a run_dir to keep them)")
        self._stop()
        self._error = msg
        raise GroupError(msg)

    def _check_usable(self, op: str) -> None:
        if self._proc is None:
            raise GroupError(f"cannot run '{op}': {self._error or 'the training group is not running'}"
                             + ("" if self._error and "restart()" in self._error else
                                "; call restart() to start it again"))
        if self._proc.poll() is not None:
            self._fail(op, None, f"the launcher exited ({describe_code(self._proc.returncode)})")
        ranks = {conn: rank for rank, conn in self._conns.items()}
        for conn in wait(list(ranks), 0):  # an idle rank has nothing to say: readable means EOF
            try:
                recv(conn)
            except (EOFError, OSError):
                self._fail(op, ranks[conn], "its connection closed (the process died) while idle")

    # -- commands --------------------------------------------------------------------------
    def _command(self, op: str, args: dict[str, Any] | None = None, timeout: float | None = None,
                 on_stream=None) -> dict[int, dict[str, Any]]:
        """Send one command to every rank and wait for all replies; returns rank -> result."""
        self._check_usable(op)
        self._seq += 1
        msg = {"op": op, "seq": self._seq, **(args or {})}
        for rank, conn in sorted(self._conns.items()):
            try:
                send(conn, msg)
            except OSError as err:
                self._fail(op, rank, f"sending the command failed ({err})")
        timeout = timeout if timeout is not None else self.command_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: dict[int, dict[str, Any]] = {}
        while len(replies) < len(self._conns):
            waiting = {conn: rank for rank, conn in self._conns.items() if rank not in replies}
            for conn in wait(list(waiting), 0.25):
                rank = waiting[conn]
                try:
                    m = recv(conn)
                except (EOFError, OSError):
                    self._fail(op, rank, "its connection closed (the process died)")
                if m.get("kind") == "tensor":  # streamed ahead of the reply (named_weights)
                    if on_stream is not None:
                        on_stream(m)
                    continue
                if m.get("seq") != self._seq:
                    continue
                if not m.get("ok"):
                    self._fail(op, rank, "it raised an exception", rank_error=m.get("error"))
                replies[rank] = m
                self.last_rank_seconds[rank] = float(m.get("seconds", float("nan")))
                self.weight_loads_by_rank[rank] = int(m.get("weight_loads", 0))
            if self._proc is not None and self._proc.poll() is not None and len(replies) < len(self._conns):
                missing = min(r for r in self._conns if r not in replies)
                self._fail(op, missing, f"the launcher exited ({describe_code(self._proc.returncode)})")
            if deadline is not None and time.monotonic() > deadline:
                late = sorted(r for r in self._conns if r not in replies)
                self._fail(op, late[0], f"ranks {late} did not answer within {timeout:.0f} s")
        return {r: m.get("result", {}) for r, m in replies.items()}

    def weight_digests(self) -> dict[int, str]:
        """rank -> sha256 of the full weights that rank holds (gathered under ZeRO-3): equal
        digests mean the ranks agree bit for bit."""
        return {r: res["digest"] for r, res in self._command("digest").items()}

    def ping(self) -> float:
        """Round trip of an empty command through every rank (the channel's own overhead)."""
        t0 = time.perf_counter()
        self._command("ping")
        return time.perf_counter() - t0

    # -- the Trainer protocol --------------------------------------------------------------
    def train_on_batch(self, batch: TrainBatch, seed: int = 0, objective: str = "ppo",
                       epochs: int | None = None, mini_batches: int | None = None) -> dict[str, float]:
        """Send ``batch`` to every rank and train on it (the SFT stage, tests, benchmarks); the
        pipeline's RL updates use ``train_from_store``."""
        res = self._command("train", {"batch": self._batch_payload(batch), "seed": int(seed),
                                      "objective": objective, "epochs": epochs, "mini_batches": mini_batches})
        self.optimizer_steps = int(res[0]["optimizer_steps_total"])
        return dict(res[0]["metrics"])

    def _batch_payload(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        """The batch's tensors for a command, counted in ``batch_bytes_sent`` (one copy per rank)."""
        tensors = batch.tensors()
        self.batch_bytes_sent += self.world_size * sum(t.nbytes for t in tensors.values())
        return tensors

    def train_from_store(self, store: dict[str, Any], stage: int, iteration: int,
                         seed: int = 0) -> dict[str, float]:
        """Every rank reads the iteration's committed ``train_batch`` table from the trajectory
        store (``TrajectoryStore.spec()``: local path or s3://) and trains on it; only the
        reference crosses the connection."""
        res = self._command("train_from_store", {"store": dict(store), "stage": int(stage),
                                                 "iteration": int(iteration), "seed": int(seed)})
        self.optimizer_steps = int(res[0]["optimizer_steps_total"])
        return dict(res[0]["metrics"])

    def compute(self, batch: TrainBatch, what: list[str] | tuple[str, ...]) -> dict[str, torch.Tensor]:
        """``PolicyTrainer.compute`` on every rank (ZeRO-3 gathers are collectives); rank 0's
        results come back."""
        res = self._command("compute", {"batch": self._batch_payload(batch), "what": list(what)})
        return dict(res[0]["tensors"])

    def sft_metrics(self, batch: TrainBatch) -> dict[str, float]:
        """``PolicyTrainer.sft_metrics`` on every rank (ZeRO-3 gathers are collectives); rank 0's
        result comes back."""
        res = self._command("sft_metrics", {"batch": self._batch_payload(batch)})
        return dict(res[0]["metrics"])

    def advance_lr_schedule(self, steps: int) -> None:
        """Every rank steps its learning-rate schedule ``steps`` times."""
        self._command("advance_lr_schedule", {"steps": int(steps)})

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full policy weights (merged with LoRA), gathered by rank 0 and streamed here."""
        got: list[tuple[str, torch.Tensor]] = []
        self._command("weights", on_stream=lambda m: got.append((m["name"], m["tensor"])))
        return iter(got)

    def save_adapter(self, out_dir: str | Path) -> Path:
        out = Path(out_dir).resolve()
        self._command("save_adapter", {"dir": str(out)})
        return out

    def save_hf(self, out_dir: str | Path, tokenizer=None) -> Path:
        out = Path(out_dir)
        self._command("save_hf", {"dir": str(out.resolve())})
        (tokenizer or self.tokenizer).save_pretrained(out)
        return out

    def save_checkpoint(self, ckpt_dir: str | Path, client_state: dict[str, Any] | None = None) -> Path:
        ckpt = Path(ckpt_dir).resolve()
        self._command("save_checkpoint", {"dir": str(ckpt), "client_state": dict(client_state or {})})
        self.last_checkpoint = ckpt
        return ckpt

    def load_checkpoint(self, ckpt_dir: str | Path) -> dict[str, Any]:
        ckpt = Path(ckpt_dir).resolve()
        if not (ckpt / "ds").is_dir():  # checked here: a rank's exception would take the group down
            raise FileNotFoundError(f"{ckpt} holds no trainer checkpoint (no ds/ folder)")
        res = self._command("load_checkpoint", {"dir": str(ckpt)})
        self.optimizer_steps = int(res[0]["optimizer_steps_total"])
        self.last_checkpoint = ckpt
        return dict(res[0]["client_state"])
