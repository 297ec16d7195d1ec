"""Temporary folders in TMPDIR that a later process can tell are abandoned, and removes.

Why: a process killed with ``SIGKILL`` (or by the OOM killer) runs no cleanup, so its checkpoint
export (``agentgym-ckpt-*``, ``agentgym-sft-*``: a whole HF model each), the former training
group's folder (``agentgym-group-*``, still swept for older runs) or vLLM's weight folders (``agentgym-vllm-*``) stayed in TMPDIR for
ever. Their names now carry their owner -- ``<prefix>p<pid>-<start>-<ns>-<random>``: the PID, the
process's start time (clock ticks since boot, ``/proc/<pid>/stat``) and a digest of the host name
and PID namespace -- and ``make`` first removes the folders of these prefixes whose owner is gone.

A folder is removed only when all of these hold (anything uncertain is kept):

* its name has the owner format (folders of older versions, without it, are never touched);
* it was made on this host in this PID namespace (a PID means nothing elsewhere: another
  container sharing the folder has its own PIDs);
* it belongs to this user;
* its PID is not running (``os.kill(pid, 0)``), or runs a process that started at another time
  (the PID was reused by a new process).

The owner is not written into the folder (a checkpoint export is uploaded whole), only its name.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

#: the prefixes whose abandoned folders ``make`` removes
PREFIXES = ("agentgym-ckpt-", "agentgym-sft-", "agentgym-group-", "agentgym-vllm-")
_OWNED = re.compile(r"^(?P<prefix>[a-z-]+-)p(?P<pid>\d+)-(?P<start>\d+|x)-(?P<ns>[0-9a-f]{8})-")


def _start_ticks(pid: int) -> str:
    """When ``pid`` started (field 22 of ``/proc/<pid>/stat``), or "x" where that cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]  # fields after the command name start at 3
    except (OSError, IndexError):
        return "x"


def _namespace() -> str:
    """A digest of this host and PID namespace: where our PIDs mean what they say."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return hashlib.sha256(f"{socket.gethostname()}\0{ns}".encode()).hexdigest()[:8]


def _alive(pid: int, start: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # running, as another user
    except OSError as e:
        return e.errno != errno.ESRCH
    # a PID reused by a later process: it started at another time (unknown times: assume alive)
    return start == "x" or _start_ticks(pid) in ("x", start)


def owner_tag() -> str:
    """The owner part of this process's folder names: ``p<pid>-<start>-<ns>-``."""
    pid = os.getpid()
    return f"p{pid}-{_start_ticks(pid)}-{_namespace()}-"


def sweep(root: str | os.PathLike | None = None, prefixes: tuple[str, ...] = PREFIXES) -> list[Path]:
    """Remove the folders of ``prefixes`` in ``root`` (TMPDIR) whose owning process is gone
    (see the module doc); returns those removed."""
    root = Path(root or tempfile.gettempdir())
    ns, uid = _namespace(), os.getuid()
    removed: list[Path] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        m = _OWNED.match(entry.name)
        if not m or m["prefix"] not in prefixes or m["ns"] != ns:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != uid:
                continue
        except OSError:
            continue
        if _alive(int(m["pid"]), m["start"]):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.exists(entry.path):
            removed.append(Path(entry.path))
    if removed:
        log.info("removed %d temporary folder(s) left by killed processes in %s: %s", len(removed), root,
                 ", ".join(p.name for p in removed))
    return removed


def make(prefix: str, root: str | os.PathLike | None = None) -> Path:
    """A new folder ``<root>/<prefix>p<pid>-...`` (root: TMPDIR), after removing abandoned ones."""
    sweep(root)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{owner_tag()}", dir=root))


@contextlib.contextmanager
def scratch(prefix: str, root: str | os.PathLike | None = None) -> Iterator[str]:
    """``tempfile.TemporaryDirectory`` whose folder a later ``make`` removes if this process is
    killed before it can."""
    folder = make(prefix, root)
    try:
        yield str(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
