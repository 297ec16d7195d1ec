"""A write that ran out of disk space, reported as one clear ``OSError(ENOSPC)``.

Why: a full disk reaches the code in several disguises, none naming the file or the disk:

* Python's own writes: ``OSError(28, 'No space left on device')`` with no file name (the
  failing call is ``write``, not ``open``);
* safetensors (HF exports): ``SafetensorError('Error while serializing: I/O error: No space
  left on device (os error 28)')``, not an ``OSError`` at all;
* ``torch.save`` (DeepSpeed checkpoints, RNG states): ``RuntimeError('[enforce fail at
  inline_container.cc:672] . unexpected pos 576 vs 534')``, which does not mention space.

``disk_errors(what, path)`` turns each of them into ``OSError(errno.ENOSPC, "No space left on
device: <what> <path> ...")`` that names what was being written, where, and how much space the
disk has left (observed with a 64 KiB tmpfs). Any other error passes through unchanged.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

__all__ = ["disk_errors", "error_chain", "free_bytes", "is_out_of_space", "names_the_disk"]

# An opaque write error (torch.save's) on a disk with less than this free is taken as "full".
NEARLY_FULL_BYTES = 1 << 20
_MARKERS = ("no space left on device", "os error 28", "disk quota exceeded")


def names_the_disk(err: OSError) -> OSError:
    """Mark ``err`` as already naming the file and the disk: an outer ``disk_errors`` (or
    ``prefect_db.prefect_disk_error``) passes it on unchanged. An attribute, not a subclass, so
    that messages still read ``OSError: [Errno 28] ...``."""
    setattr(err, "names_the_disk", True)
    return err


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the local disk holding ``path`` (its nearest existing parent); None for a
    URL (``s3://``) or where it cannot be told."""
    p = str(path)
    if "://" in p and not p.startswith("file://"):
        return None
    here = Path(p.removeprefix("file://")).expanduser().absolute()
    for candidate in (here, *here.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def error_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or during (``__cause__``, else
    ``__context__``), each once: where a library's wrapper hides the error that says what failed."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def is_out_of_space(exc: BaseException, path: str | os.PathLike | None = None,
                    opaque: tuple[type[BaseException], ...] = (OSError, RuntimeError)) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a write that found the disk
    full: ENOSPC / EDQUOT, the text of either, or an opaque failure (of the ``opaque`` types)
    while ``path``'s disk has almost nothing free."""
    for e in error_chain(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(m in str(e).lower() for m in _MARKERS):
            return True
    if path is not None and isinstance(exc, opaque):
        free = free_bytes(path)
        return free is not None and free < NEARLY_FULL_BYTES
    return False


@contextlib.contextmanager
def disk_errors(what: str, path: str | os.PathLike, fix: str = "free space on that disk",
                opaque: tuple[type[BaseException], ...] = (OSError, RuntimeError)) -> Iterator[None]:
    """Run a write of ``what`` to ``path``; if it fails for lack of space, raise
    ``OSError(ENOSPC)`` naming both (and ``fix``) from the original error. ``opaque``: the
    error types taken for a full disk when they say nothing but the disk is (nearly) full."""
    try:
        yield
    except Exception as e:
        if getattr(e, "names_the_disk", False) or not is_out_of_space(e, path, opaque):
            raise  # not a full disk, or already named by an inner disk_errors
        free = free_bytes(path)
        left = f"{free:,} bytes free there" if free is not None else "free space unknown"
        err = OSError(errno.ENOSPC, f"No space left on device: {what} could not be written to "
                                    f"{path} ({left}); {fix}")
        raise names_the_disk(err) from e
