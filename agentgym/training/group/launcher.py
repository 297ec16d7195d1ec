"""Starting the resident group's ranks and reading what happened to them.

``torchrun`` on this host; across hosts either ``torchrun`` on every node (``trainer.nnodes``:
static rendezvous at ``master_addr:master_port``, node 0 started by the pipeline, the others by
``agentgym group join``, so no ssh is needed) or, with a hostfile, the ``deepspeed`` launcher
over pdsh/ssh. After a failure the launcher's own report is the source of truth: it names each
rank's exit code and, for torchrun, the rank that failed first (the others it ended itself);
with ``nnodes`` the pipeline's host sees only node 0's launcher.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from agentgym.config import TrainerConfig
from agentgym.training.group.dist_env import rank_env
from agentgym.training.group.rpc import AUTHKEY_ENV

WORKER_MODULE = "agentgym.training.group.worker"
# what the deepspeed launcher must export on every host (pdsh/ssh drops the environment)
DS_ENV_KEYS = ("PYTHONPATH", "OMP_NUM_THREADS", "AGENTGYM_THREADS", "DS_ACCELERATOR", "TOKENIZERS_PARALLELISM")


def hostfile_slots(path: str) -> int:
    """Total ``slots=N`` of a DeepSpeed hostfile (one ``host slots=N`` per line)."""
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


def launcher_cmd(cfg: TrainerConfig, world_size: int, driver: tuple[str, int], master_port: int,
                 log_dir: Path, node_rank: int = 0) -> list[str]:
    """The command that starts ``world_size`` ranks of ``WORKER_MODULE`` (with ``cfg.nnodes`` >
    1: node ``node_rank``'s ``world_size / nnodes`` of them), each told where the driver listens."""
    worker = ["-m", WORKER_MODULE, "--driver", f"{driver[0]}:{driver[1]}", "--log-dir", str(log_dir)]
    if cfg.hostfile is None:
        # static rendezvous (torchrun's default with --node-rank): global rank = node_rank *
        # per_node + local rank, so node 0 (the pipeline's host) holds rank 0
        nodes = [] if cfg.nnodes == 1 else [f"--node-rank={node_rank}"]
        # --log-dir: torchrun's own folder (error files) inside ours, removed with the group;
        # without it torchrun leaves a /tmp/torchelastic_* folder behind per launch
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={cfg.nnodes}", *nodes,
                f"--nproc-per-node={world_size // cfg.nnodes}", f"--master-addr={cfg.master_addr}",
                f"--master-port={master_port}", "--max-restarts=0", "--monitor-interval=0.2",
                f"--log-dir={log_dir / 'torchrun'}", *worker]
    launcher = shutil.which("deepspeed") or str(Path(sys.executable).parent / "deepspeed")
    return [launcher, "--hostfile", cfg.hostfile, "--master_addr", cfg.master_addr,
            "--master_port", str(master_port), "--no_local_rank", "--module", *worker[1:]]


def shared_authkey() -> bytes:
    """The group key of a multi-node (``nnodes`` > 1) group: every node must know it before the
    group starts, so it comes from ``AGENTGYM_GROUP_AUTHKEY`` in each node's environment (never
    from the config, which is logged)."""
    raw = os.environ.get(AUTHKEY_ENV, "")
    try:
        key = bytes.fromhex(raw)
    except ValueError:
        key = b""
    if len(key) < 16:
        raise ValueError(f"trainer.nnodes > 1 needs the same {AUTHKEY_ENV} (at least 32 hex characters) in "
                         "the environment of every node, e.g. from python -c 'import secrets; "
                         f"print(secrets.token_hex(32))'; got {'nothing' if not raw else 'an invalid value'}")
    return key


def join_node(cfg: TrainerConfig, node_rank: int, log_dir: Path, threads_per_rank: int | None = None) -> int:
    """Run node ``node_rank``'s share of a multi-node group (``agentgym group join``) in the
    foreground until the group ends; returns torchrun's exit code. Its ranks wait in the
    rendezvous until node 0 (the pipeline's ``ResidentGroup``) starts, then connect to the driver
    at ``master_addr:driver_port``. A group restarted after a failure needs this run again (e.g.
    in a shell loop or under a supervisor that restarts it)."""
    if cfg.nnodes < 2:
        raise ValueError("agentgym group join is for trainer.nnodes > 1; with one node the pipeline "
                         "starts every rank itself")
    if not 1 <= node_rank < cfg.nnodes:
        raise ValueError(f"--node-rank {node_rank}: other nodes are 1 .. {cfg.nnodes - 1} (node 0 is "
                         "the pipeline's host, which starts its ranks itself)")
    if cfg.master_port is None or cfg.driver_port is None:  # TrainerConfig requires both with nnodes > 1
        raise ValueError("agentgym group join needs trainer.master_port and trainer.driver_port set, the "
                         "same as on node 0")
    shared_authkey()  # fail here, not in every rank
    per_node = cfg.world_size // cfg.nnodes
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = launcher_cmd(cfg, cfg.world_size, (cfg.master_addr, cfg.driver_port), cfg.master_port, log_dir,
                       node_rank=node_rank)
    env = rank_env(threads_per_rank or max(1, (os.cpu_count() or 1) // per_node))
    return subprocess.call(cmd, env=env, stdin=subprocess.DEVNULL)


def write_ds_env_file(run_dir: Path, env: dict[str, str], secret_keys: tuple[str, ...] = ()) -> Path:
    """The ``DS_ENV_FILE`` the deepspeed launcher exports on every host (owner-readable only:
    it may hold the group's key)."""
    path = run_dir / "deepspeed_env"
    keys = DS_ENV_KEYS + secret_keys
    path.write_text("".join(f"{k}={env[k]}\n" for k in keys if k in env))
    path.chmod(0o600)
    return path.resolve()


def exit_codes(launcher_log: str) -> dict[int, int]:
    """Per-rank exit codes from the launcher's failure report (torchrun's summary, or
    DeepSpeed's launch.py), as far as it gives them."""
    codes: dict[int, int] = {}
    for m in re.finditer(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", launcher_log):
        codes[int(m.group(1))] = int(m.group(2))
    return codes


def root_cause(launcher_log: str) -> int | None:
    """The rank torchrun names as the first observed failure (the others it ended itself)."""
    if "Root Cause" not in launcher_log:
        return None
    m = re.search(r"rank\s*:\s*(\d+)", launcher_log.split("Root Cause", 1)[1])
    return int(m.group(1)) if m else None


def describe_code(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"exit code {code}"
    return f"exit code {code}"


def tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.rstrip().splitlines()[-lines:])


def kill_tree(proc: subprocess.Popen) -> None:
    """End the launcher and its ranks: it leads its own session, so they share its group."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def post_mortem(op: str, rank: int | None, why: str, rank_error: str | None, world_size: int,
                log_dir: Path, launcher_log: Path) -> str:
    """The ``GroupError`` message: which rank failed during ``op`` and how (exit code), its log
    tail and its traceback (``rank_error``, when it raised), and the launcher's log tail.

    The launcher ends the surviving ranks after the first failure, so the driver may notice one
    of those first: the rank the launcher's report names as the root cause is blamed instead.
    """
    launcher_text = tail(launcher_log, 400)
    codes = exit_codes(launcher_text)
    root = root_cause(launcher_text)
    if rank_error is None and root is not None and root != rank:
        if rank is not None:
            why = (f"it died first (the launcher's report), then the launcher ended the other "
                   f"ranks (rank {rank} was noticed first)")
        rank = root
    elif rank is None and codes:
        rank = min(codes)
    parts = [f"training group failed during '{op}': {why}"]
    if rank is not None:
        what = why if rank_error is not None else f"{describe_code(codes.get(rank))}; {why}"
        parts[0] = f"training rank {rank} of {world_size} failed during '{op}': {what}"
        parts.append(f"--- rank {rank} log ({log_dir / f'rank{rank}.log'}), last lines ---\n"
                     + tail(log_dir / f"rank{rank}.log"))
    if rank_error:
        parts.append(f"--- rank {rank} error ---\n{rank_error}")
    parts.append(f"--- launcher log ({launcher_log}), last lines ---\n" + tail(launcher_log, 15))
    parts.append("the group is down: call restart() (reloads the last checkpoint) or close()")
    return "\n".join(parts)
