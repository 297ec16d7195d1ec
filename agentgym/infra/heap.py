"""Give the C heap's freed-but-kept pages back to the OS (glibc ``malloc_trim(0)``).

Why: glibc keeps freed memory inside its arenas, and its mmap threshold rises (up to 32 MiB)
each time a large mmapped block is freed, so after a few frees weight-sized tensors come from
the arenas too. A vLLM CPU weight update (``VLLMEngine._recreate_with``) frees one engine and its
state dict and builds another; without a trim the process keeps the freed engine's pages (kept
for reuse, not a leak: docs/reliability.md has the measured RSS).

A no-op (returns False) where the C library has no ``malloc_trim`` (musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from typing import Literal

# libc's malloc_trim once looked up; False where the C library has none
_trim: Callable[[int], int] | Literal[False] | None = None


def _malloc_trim():
    global _trim
    if _trim is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            trim = libc.malloc_trim
            trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
            _trim = trim
        except (OSError, AttributeError):
            _trim = False
    return _trim


def release_freed_heap() -> bool:
    """``malloc_trim(0)``: return free heap pages of every arena to the OS. True if it ran."""
    trim = _malloc_trim()
    if not trim:
        return False
    trim(0)
    return True
