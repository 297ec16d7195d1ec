"""Training at world size N > 1: a resident group of N DeepSpeed ranks.

``ResidentGroup`` has the interface of ``PolicyTrainer`` (``train_on_batch``, ``compute``,
``named_weights``, ``save_hf``, ``save_checkpoint`` / ``load_checkpoint``, ``pad_id``,
``optimizer_steps``, ``close``); a critic (estimator gae) lives in the ranks beside the policy.
It starts the ranks ONCE, with ``torchrun`` on this host or, given a hostfile, the
``deepspeed`` launcher (pdsh) across hosts. Each rank builds a ``PolicyTrainer`` (one read of the
weights from disk) and then waits for commands, so weights and optimizer state stay in the ranks'
memory between iterations.

Channel: the driver (this process) listens on ``master_addr`` on a free port; every rank connects
and says hello with its rank, pid and a per-group token. Commands and replies are length-prefixed
``torch.save`` messages (loaded with ``weights_only=True``: plain values and tensors only). A
command goes to every rank; each rank answers it. ``train`` sends the whole ``TrainBatch`` to
every rank (each trains on its slice, see ``agentgym.training``); ``weights`` makes every rank
iterate ``named_weights()`` (ZeRO-3 gathers are collectives) while rank 0 streams the tensors
back. Idle ranks block on their socket, not in a collective, so long rollouts cannot trip a
collective timeout, and a rank whose driver vanished sees EOF and exits: no orphans.

Failures: a rank that dies (its socket closes or the launcher exits) or answers with an
exception takes the group down: the call raises ``GroupError`` naming the rank, its exit code
(from the launcher's report) and the tail of its log; later calls raise it again until
``restart()``, which relaunches the group and reloads the last checkpoint this group saved or
loaded. ``close()`` is idempotent and always ends the launcher's process tree.
"""

from __future__ import annotations

import atexit
import hashlib
import io
import os
import re
import secrets
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import torch

from agentgym.config import AlgorithmConfig, TrainerConfig

_HEADER = struct.Struct("!Q")


class GroupError(RuntimeError):
    """A rank of the resident training group died or failed; the group is down."""


# -- wire format ---------------------------------------------------------------------------
def _pack(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    return _HEADER.pack(len(data)) + data


def _unpack(data: bytes | memoryview) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def _send(sock: socket.socket, obj: Any) -> None:
    sock.sendall(_pack(obj))


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return None
        got += k
    return bytes(buf)


def _recv(sock: socket.socket) -> Any | None:
    """One message, or None at EOF."""
    head = _recv_exact(sock, _HEADER.size)
    if head is None:
        return None
    body = _recv_exact(sock, _HEADER.unpack(head)[0])
    return None if body is None else _unpack(body)


class _Peer:
    """The driver's end of one rank's connection, with an incremental receive buffer."""

    def __init__(self, sock: socket.socket, rank: int, pid: int, host: str):
        self.sock, self.rank, self.pid, self.host = sock, rank, pid, host
        self.buf = bytearray()
        sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def pump(self) -> tuple[list[Any], bool]:
        """Read what is there: (complete messages, eof)."""
        eof = False
        while True:
            try:
                chunk = self.sock.recv(1 << 22)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                eof = True
                break
            if not chunk:
                eof = True
                break
            self.buf += chunk
        msgs = []
        while len(self.buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self.buf)
            if len(self.buf) < _HEADER.size + n:
                break
            msgs.append(_unpack(memoryview(self.buf)[_HEADER.size:_HEADER.size + n]))
            del self.buf[:_HEADER.size + n]
        return msgs, eof

    def send(self, obj: Any) -> None:
        self.sock.setblocking(True)
        try:
            self.sock.sendall(_pack(obj))
        finally:
            self.sock.setblocking(False)


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _exit_codes(launcher_log: str) -> dict[int, int]:
    """Per-rank exit codes from the launcher's failure report (torchrun's summary, or
    DeepSpeed's launch.py), as far as it gives them."""
    codes: dict[int, int] = {}
    for m in re.finditer(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", launcher_log):
        codes[int(m.group(1))] = int(m.group(2))
    return codes


def _root_cause(launcher_log: str) -> int | None:
    """The rank torchrun names as the first observed failure (the others it ended itself)."""
    if "Root Cause" not in launcher_log:
        return None
    m = re.search(r"rank\s*:\s*(\d+)", launcher_log.split("Root Cause", 1)[1])
    return int(m.group(1)) if m else None


def _hostfile_slots(path: str) -> int:
    total = 0
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.search(r"slots\s*=\s*(\d+)", line)
        if not m:
            raise ValueError(f"hostfile {path}: line {line!r} has no slots=N")
        total += int(m.group(1))
    return total


def _describe_code(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"exit code {code}"
    return f"exit code {code}"


_LIVE: "weakref.WeakSet[ResidentGroup]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for g in list(_LIVE):
        g.close()


class ResidentGroup:
    """N training ranks started once; the driver side. Same interface as ``PolicyTrainer``."""

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
            slots = _hostfile_slots(trainer.hostfile)
            if slots != trainer.world_size:
                raise ValueError(f"hostfile {trainer.hostfile} has {slots} slots but "
                                 f"trainer.world_size={trainer.world_size}; make them equal")
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.cfg, self.algo = trainer, algorithm
        self.world_size = trainer.world_size
        self.start_timeout_s, self.command_timeout_s = start_timeout_s, command_timeout_s
        self._own_dir = run_dir is None
        self.run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="agentgym-group-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._init_args = {
            "model_path": str(model_path), "pad_id": self.pad_id,
            "trainer": trainer.model_dump(mode="json"), "algorithm": algorithm.model_dump(mode="json"),
            "temperature": float(temperature), "seed": int(seed),
        }
        cpus = os.cpu_count() or 1
        self.threads_per_rank = threads_per_rank or max(1, cpus // self.world_size)
        self.optimizer_steps = 0
        self.batch_bytes_sent = 0  # batch tensors sent over the sockets (train_from_store sends none)
        self.weight_loads_by_rank: dict[int, int] = {}
        self.restarts = 0
        self.last_checkpoint: Path | None = None
        self.timings: dict[str, float] = {}
        self.last_rank_seconds: dict[int, float] = {}  # time each rank spent on the last command
        self._peers: dict[int, _Peer] = {}
        self._proc: subprocess.Popen | None = None
        self._listener: socket.socket | None = None
        self._error: str | None = None
        self._seq = 0
        self._attempt = 0
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
        return {r: p.pid for r, p in self._peers.items()}

    def _launcher_cmd(self, port: int, master_port: int, token: str) -> list[str]:
        worker = ["-m", "agentgym.distributed", "--driver", f"{self.cfg.master_addr}:{port}",
                  "--token", token, "--log-dir", str(self.log_dir)]
        if self.cfg.hostfile is None:
            return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                    f"--nproc-per-node={self.world_size}", f"--master-addr={self.cfg.master_addr}",
                    f"--master-port={master_port}", "--max-restarts=0", "--monitor-interval=0.2",
                    *worker]
        launcher = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
        return [launcher, "--hostfile", self.cfg.hostfile, "--master_addr", self.cfg.master_addr,
                "--master_port", str(master_port), "--no_local_rank", "--module", *worker[1:]]

    def _start(self) -> None:
        from agentgym.training import _free_port

        t0 = time.perf_counter()
        self._attempt += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._error = None
        self._peers = {}
        self.weight_loads_by_rank = {}
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.cfg.master_addr, 0))
        listener.listen(self.world_size)
        listener.settimeout(0.5)
        self._listener = listener
        token = secrets.token_hex(16)
        env = dict(os.environ)
        pkg_root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
        env["OMP_NUM_THREADS"] = str(self.threads_per_rank)
        env["AGENTGYM_THREADS"] = str(self.threads_per_rank)
        env.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
            env.pop(k, None)  # the driver's own single-process group must not leak into the ranks
        cmd = self._launcher_cmd(listener.getsockname()[1], _free_port(), token)
        if self.cfg.hostfile is not None:
            # The deepspeed launcher reaches other hosts through pdsh/ssh, which drops the
            # environment; it exports the variables listed in DS_ENV_FILE on every host.
            env_file = self.run_dir / "deepspeed_env"
            keep = ("PYTHONPATH", "OMP_NUM_THREADS", "AGENTGYM_THREADS", "DS_ACCELERATOR", "TOKENIZERS_PARALLELISM")
            env_file.write_text("".join(f"{k}={env[k]}\n" for k in keep if k in env))
            env["DS_ENV_FILE"] = str(env_file.resolve())
        self._launcher_log = self.log_dir / "launcher.log"
        with open(self._launcher_log, "ab") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=env, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while len(self._peers) < self.world_size:
            if self._proc.poll() is not None:
                self._fail("start", None, f"the launcher exited ({_describe_code(self._proc.returncode)}) "
                           f"before all ranks connected")
            if time.monotonic() > deadline:
                self._fail("start", None, f"only ranks {sorted(self._peers)} connected within "
                           f"{self.start_timeout_s:.0f} s")
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            conn.settimeout(30)
            try:
                hello = _recv(conn)
            except Exception:  # noqa: BLE001 - a stray connection: ignore it
                conn.close()
                continue
            if not isinstance(hello, dict) or hello.get("token") != token:
                conn.close()
                continue
            conn.settimeout(None)
            self._peers[int(hello["rank"])] = _Peer(conn, int(hello["rank"]), int(hello["pid"]), hello["host"])
        self.timings["launch_s"] = time.perf_counter() - t0
        self._command("init", self._init_args, timeout=self.start_timeout_s)
        self.timings["start_s"] = time.perf_counter() - t0

    def close(self) -> None:
        """Stop the ranks (politely, then by signal to the launcher's process group)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            for peer in self._peers.values():
                try:
                    peer.send({"op": "exit", "seq": -1})
                except OSError:
                    pass
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._kill_tree(proc)
        for peer in self._peers.values():
            try:
                peer.sock.close()
            except OSError:
                pass
        self._peers = {}
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._error is None:
            self._error = "the training group was closed"

    @staticmethod
    def _kill_tree(proc: subprocess.Popen) -> None:
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
            try:
                os.killpg(proc.pid, sig)  # the launcher leads its own session: its ranks are in it
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def restart(self) -> dict[str, Any]:
        """Relaunch the group (after a failure) and reload the last checkpoint it saved or
        loaded; returns that checkpoint's client_state ({} when there was none: the ranks then
        start again from the model folder)."""
        self.close()
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
            self.close()  # the ranks are alive: ask them to exit (a rank stuck in a collective is killed)
        elif proc is not None:
            try:  # the launcher notices a dead rank, ends the others and reports exit codes
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._kill_tree(proc)
        launcher_text = _tail(self._launcher_log, 400) if hasattr(self, "_launcher_log") else ""
        codes = _exit_codes(launcher_text)
        root = _root_cause(launcher_text)
        if rank_error is None and root is not None and root != rank:
            # The launcher ends the surviving ranks after the first failure; we may have noticed
            # one of those first. Blame the one that failed first.
            if rank is not None:
                why = (f"it died first (the launcher's report), then the launcher ended the other "
                       f"ranks (rank {rank} was noticed first)")
            rank = root
        elif rank is None and codes:
            rank = min(codes)
        parts = [f"training group failed during '{op}': {why}"]
        if rank is not None:
            what = why if rank_error is not None else f"{_describe_code(codes.get(rank))}; {why}"
            parts[0] = f"training rank {rank} of {self.world_size} failed during '{op}': {what}"
            parts.append(f"--- rank {rank} log ({self.log_dir / f'rank{rank}.log'}), last lines ---\n"
                         + _tail(self.log_dir / f"rank{rank}.log"))
        if rank_error:
            parts.append(f"--- rank {rank} error ---\n{rank_error}")
        parts.append(f"--- launcher log ({self._launcher_log}), last lines ---\n" + _tail(self._launcher_log, 15))
        parts.append("the group is down: call restart() (reloads the last checkpoint) or close()")
        msg = "\n".join(parts)
        self.close()
        self._error = msg
        raise GroupError(msg)

    def _check_usable(self, op: str) -> None:
        if self._proc is None:
            raise GroupError(f"cannot run '{op}': {self._error or 'the training group is not running'}"
                             + ("" if self._error and "restart()" in self._error else
                                "; call restart() to start it again"))
        if self._proc.poll() is not None:
            self._fail(op, None, f"the launcher exited ({_describe_code(self._proc.returncode)})")
        ready, _, _ = select.select(list(self._peers.values()), [], [], 0)
        for peer in ready:  # an idle rank has nothing to say: readable means EOF (it died)
            _, eof = peer.pump()
            if eof:
                self._fail(op, peer.rank, "its connection closed (the process died) while idle")

    # -- commands --------------------------------------------------------------------------
    def _command(self, op: str, args: dict[str, Any] | None = None, timeout: float | None = None,
                 on_stream=None) -> dict[int, dict[str, Any]]:
        """Send one command to every rank and wait for all replies; returns rank -> result."""
        self._check_usable(op)
        self._seq += 1
        msg = {"op": op, "seq": self._seq, **(args or {})}
        for rank, peer in sorted(self._peers.items()):
            try:
                peer.send(msg)
            except OSError as err:
                self._fail(op, rank, f"sending the command failed ({err})")
        timeout = timeout if timeout is not None else self.command_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: dict[int, dict[str, Any]] = {}
        while len(replies) < len(self._peers):
            waiting = [p for r, p in self._peers.items() if r not in replies]
            ready, _, _ = select.select(waiting, [], [], 0.25)
            for peer in ready:
                msgs, eof = peer.pump()
                for m in msgs:
                    if m.get("kind") == "tensor":
                        if on_stream is not None:
                            on_stream(m)
                        continue
                    if m.get("seq") != self._seq:
                        continue
                    if not m.get("ok"):
                        self._fail(op, peer.rank, "it raised an exception", rank_error=m.get("error"))
                    replies[peer.rank] = m
                    self.last_rank_seconds[peer.rank] = float(m.get("seconds", float("nan")))
                    self.weight_loads_by_rank[peer.rank] = int(m.get("weight_loads", 0))
                if eof and peer.rank not in replies:
                    self._fail(op, peer.rank, "its connection closed (the process died)")
            if self._proc is not None and self._proc.poll() is not None and len(replies) < len(self._peers):
                missing = min(r for r in self._peers if r not in replies)
                self._fail(op, missing, f"the launcher exited ({_describe_code(self._proc.returncode)})")
            if deadline is not None and time.monotonic() > deadline:
                missing = sorted(r for r in self._peers if r not in replies)
                self._fail(op, missing[0], f"ranks {missing} did not answer within {timeout:.0f} s")
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

    # -- PolicyTrainer interface -----------------------------------------------------------
    def train_on_batch(self, batch, seed: int = 0) -> dict[str, float]:
        """Send ``batch`` to every rank and train on it (tests, benchmarks); the pipeline uses
        ``train_from_store``."""
        res = self._command("train", {"batch": self._batch_payload(batch), "seed": int(seed)})
        self.optimizer_steps = int(res[0]["optimizer_steps_total"])
        return dict(res[0]["metrics"])

    def _batch_payload(self, batch) -> dict[str, torch.Tensor]:
        """The batch's tensors for a command, counted in ``batch_bytes_sent`` (one copy per rank)."""
        tensors = batch.tensors()
        self.batch_bytes_sent += self.world_size * sum(t.nbytes for t in tensors.values())
        return tensors

    def train_from_store(self, store: dict[str, Any], stage: int, iteration: int,
                         seed: int = 0) -> dict[str, float]:
        """Every rank reads the iteration's committed ``train_batch`` table from the trajectory
        store (``TrajectoryStore.spec()``: local path or s3://) and trains on it; only the
        reference crosses the socket."""
        res = self._command("train_from_store", {"store": dict(store), "stage": int(stage),
                                                 "iteration": int(iteration), "seed": int(seed)})
        self.optimizer_steps = int(res[0]["optimizer_steps_total"])
        return dict(res[0]["metrics"])

    def compute(self, batch, what) -> dict[str, torch.Tensor]:
        """``PolicyTrainer.compute`` on every rank (ZeRO-3 gathers are collectives); rank 0's
        results come back."""
        res = self._command("compute", {"batch": self._batch_payload(batch), "what": list(what)})
        return dict(res[0]["tensors"])

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full policy weights (merged with LoRA), gathered by rank 0 and streamed here."""
        got: list[tuple[str, torch.Tensor]] = []
        self._command("weights", on_stream=lambda m: got.append((m["name"], m["tensor"])))
        return iter(got)

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


# -- the rank side ---------------------------------------------------------------------------
def _plain(obj: Any) -> Any:
    """Make a reply loadable with weights_only=True (no numpy scalars and such)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (str, int, float, bool, type(None), torch.Tensor)):
        return obj
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def worker_main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="one rank of agentgym's resident training group")
    ap.add_argument("--driver", required=True, help="host:port the driver listens on")
    ap.add_argument("--token", required=True)
    ap.add_argument("--log-dir", required=True)
    args = ap.parse_args(argv)
    rank = int(os.environ["RANK"])
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / f"rank{rank}.log", "ab", buffering=0)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    torch.set_num_threads(int(os.environ.get("AGENTGYM_THREADS", "1")))
    host, port = args.driver.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.settimeout(None)
    _send(sock, {"token": args.token, "rank": rank, "pid": os.getpid(), "host": socket.gethostname()})
    print(f"rank {rank} pid {os.getpid()} connected to {args.driver}", flush=True)

    from agentgym import training as T

    trainer: T.PolicyTrainer | None = None
    pad_id = 0
    while True:
        msg = _recv(sock)
        if msg is None:  # the driver is gone: nothing left to serve
            print(f"rank {rank}: driver closed the channel, exiting", flush=True)
            return 0
        op, seq = msg["op"], msg["seq"]
        t0 = time.perf_counter()
        try:
            result: dict[str, Any] = {}
            if op == "exit":
                return 0
            if op == "init":
                pad_id = int(msg["pad_id"])
                trainer = T.PolicyTrainer(
                    msg["model_path"], SimpleNamespace(pad_token_id=msg["pad_id"]),
                    TrainerConfig.model_validate(msg["trainer"]),
                    AlgorithmConfig.model_validate(msg["algorithm"]),
                    temperature=msg["temperature"], seed=msg["seed"],
                )
            elif op == "ping":
                pass
            elif op == "train":
                batch = T.TrainBatch(**msg["batch"])
                result["metrics"] = trainer.train_on_batch(batch, seed=msg["seed"])
            elif op == "train_from_store":  # the batch comes from the trajectory store, not the socket
                from agentgym.store import TrajectoryStore

                store = TrajectoryStore(**msg["store"])
                rows = store.read_train_rows(msg["stage"], msg["iteration"])
                batch = T.TrainBatch.from_rows(rows, pad_id)
                result["metrics"] = trainer.train_on_batch(batch, seed=msg["seed"])
                result["rows"] = len(rows)
            elif op == "compute":
                got = trainer.compute(T.TrainBatch(**msg["batch"]), msg["what"])
                result["tensors"] = got if rank == 0 else {}
            elif op == "weights":
                for name, t in trainer.named_weights():
                    if rank == 0:
                        t = t.detach()
                        if t.untyped_storage().nbytes() != t.nbytes or not t.is_contiguous():
                            t = t.contiguous().clone()  # a view would send its whole storage
                        _send(sock, {"kind": "tensor", "seq": seq, "name": name, "tensor": t})
            elif op == "digest":
                h = hashlib.sha256()
                for name, t in trainer.named_weights():
                    t = t.detach().contiguous()
                    h.update(name.encode())
                    h.update(t.view(torch.uint8).numpy().tobytes() if t.dim() else t.reshape(1).view(torch.uint8).numpy().tobytes())
                result["digest"] = h.hexdigest()
            elif op == "save_hf":
                trainer.save_hf(msg["dir"], None)
            elif op == "save_checkpoint":
                trainer.save_checkpoint(msg["dir"], msg["client_state"])
            elif op == "load_checkpoint":
                result["client_state"] = trainer.load_checkpoint(msg["dir"])
            else:
                raise ValueError(f"unknown command {op!r}")
            if trainer is not None:
                result["optimizer_steps_total"] = trainer.optimizer_steps
            reply = {"kind": "reply", "seq": seq, "ok": True, "result": _plain(result),
                     "weight_loads": T.weight_loads(), "seconds": time.perf_counter() - t0}
        except Exception:  # noqa: BLE001 - reported to the driver, which takes the group down
            err = traceback.format_exc()
            print(err, flush=True)
            reply = {"kind": "reply", "seq": seq, "ok": False, "error": err}
        _send(sock, reply)


if __name__ == "__main__":
    sys.exit(worker_main())
