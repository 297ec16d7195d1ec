"""Two ways to run out of disk space for real in a test.

* ``FullDiskFS``: an fsspec local filesystem whose writes fail with ``OSError(ENOSPC)`` once a
  byte budget is spent (the bytes that fit are written first, as a real disk does). Works
  everywhere, so the store's behaviour on a full disk is always tested.
* ``tmpfs(size)``: a small tmpfs mounted for the test, which the kernel itself fills (then every
  writer -- Python, safetensors, torch.save, SQLite, MLflow -- meets the real ENOSPC). Needs
  ``mount`` (root in a container usually has it); the test is skipped where it is refused.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from fsspec.implementations.local import LocalFileSystem


class _Metered:
    """A writable file of ``FullDiskFS``: counts bytes against the filesystem's budget."""

    def __init__(self, f, fs: FullDiskFS):
        self._f, self._fs = f, fs

    def write(self, data) -> int:
        fs = self._fs
        if fs.budget is not None and fs.written + len(data) > fs.budget:
            fits = max(0, fs.budget - fs.written)
            self._f.write(bytes(data[:fits]))  # a disk fills up to the last byte, then refuses
            fs.written += fits
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fs.written += len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


class FullDiskFS(LocalFileSystem):
    """Local files, but at most ``budget`` bytes can be written (None: no limit)."""

    cachable = False  # fsspec would otherwise hand every caller the same instance

    def __init__(self, budget: int | None = None, **kw):
        super().__init__(**kw)
        self.budget, self.written = budget, 0

    def _open(self, path, mode="rb", **kw):
        f = super()._open(path, mode, **kw)
        return f if "r" in mode else _Metered(f, self)


@contextlib.contextmanager
def tmpfs(size: str) -> Iterator[Path]:
    """A fresh tmpfs of ``size`` (e.g. ``"4m"``) on a temporary folder, unmounted afterwards."""
    where = tempfile.mkdtemp(prefix="agentgym-tmpfs-")
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", where],
                           capture_output=True, text=True, timeout=30)
        reason = r.stderr.strip() if r.returncode else ""
    except (OSError, subprocess.SubprocessError) as e:
        reason = str(e)
    if reason:
        os.rmdir(where)
        pytest.skip(f"cannot mount a tmpfs here ({reason}); FullDiskFS tests still run")
    try:
        yield Path(where)
    finally:
        subprocess.run(["umount", "-l", where], capture_output=True, timeout=30)
        os.rmdir(where)


def fill(disk: Path) -> Path:
    """Take every free byte of ``disk`` with one file (outside anything the test inspects)."""
    filler = disk / "filler.bin"
    chunk = b"\0" * (64 << 10)
    with open(filler, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    # the last partial chunk: fill the remainder byte-exactly (small writes)
    with open(filler, "ab", buffering=0) as fh, contextlib.suppress(OSError):
        while True:
            fh.write(b"\0" * 512)
    return filler

