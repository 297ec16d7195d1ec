"""The local model cache: where named models are built, and how a folder appears there atomically.

Folders are built into a temporary sibling directory and renamed into place, so a reader never
sees a half-written folder and two processes racing to build the same folder are both fine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentgym.infra.diskspace import disk_errors

DEFAULT_CACHE = "~/.cache/agentgym/models"


def cache_root(cache_dir: str | os.PathLike) -> Path:
    return Path(os.path.expanduser(str(cache_dir))).resolve()


def torch_dtype(dtype: Any):
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return "auto"
    name = str(dtype).removeprefix("torch.")
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
               "float": "float32"}
    name = aliases.get(name, name)
    out = getattr(torch, name, None)
    if not isinstance(out, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use bfloat16, float16 or float32")
    return out


def dtype_kwarg() -> str:
    """``dtype=`` since transformers 4.56, ``torch_dtype=`` before."""
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


@contextlib.contextmanager
def staging(final: Path) -> Iterator[Path]:
    """A new hidden sibling folder of ``final`` to build in; removed on exit unless published.
    A full disk is reported as ENOSPC naming the folder and ``model.cache_dir`` (safetensors
    alone says "Error while serializing: I/O error", naming nothing)."""
    tmp: Path | None = None
    try:
        with disk_errors(f"model folder {final.name}", final.parent, "free space there, or point "
                         "model.cache_dir (agentgym models prepare --cache-dir) at a disk with room; "
                         "nothing partial was kept"):
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
            yield tmp
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def publish(tmp: Path, final: Path, *, replace: bool = False) -> Path:
    """Rename a finished ``tmp`` folder to ``final``; if another process won the race, keep theirs."""
    if replace and final.exists():
        trash = final.with_name(f".trash-{final.name}-{os.getpid()}-{time.time_ns()}")
        try:
            os.rename(final, trash)
        except FileNotFoundError:
            pass  # gone meanwhile: nothing to replace
        else:
            shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError:
        if (final / "config.json").exists():  # somebody else published first: use theirs
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            raise
    return final


def drop_keys(json_path: Path, keys: tuple[str, ...]) -> None:
    """Remove load-time kwargs that ``save_pretrained`` leaks into a saved config."""
    if not json_path.is_file():
        return
    data = json.loads(json_path.read_text())
    if any(k in data for k in keys):
        for k in keys:
            data.pop(k, None)
        json_path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def log(msg: str) -> None:
    print(f"[agentgym.models.folders] {msg}", file=sys.stderr, flush=True)
