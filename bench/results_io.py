"""The record every bench writes: ``bench/results/<bench>-<tag>.json``, committed as the raw
result behind a figure in bench/README.md or docs/.

One small JSON per run, with what a reader needs to judge its numbers:

* ``config``  -- the bench's arguments (and any settings it derived from them);
* ``command`` -- the command line it ran with;
* ``git``     -- the commit it ran at and whether the tree held uncommitted changes (their paths);
* ``machine`` -- CPU model and flags, cores (and the ones this process may use), RAM, torch's
  threads, the OpenMP settings, the nice level, Python, the platform, package versions;
* ``load``    -- the 1/5/15-minute load averages at start and at end (these machines are shared);
* ``date`` / ``started`` -- UTC, ISO 8601; ``wall_s`` between them;
* ``repeats`` -- every measured repeat's raw numbers (not only the best or the median);
* ``results`` -- what the bench reports from them (its table rows, medians, ratios).

The tag names the run: ``--tag`` where a bench has it, ``smoke`` for a smoke mode (those files
stay git-ignored: they check the mechanics, nothing else), else the UTC time. Set
``AGENTGYM_BENCH_RESULTS`` to write into another folder (the tests do). Nothing here imports
torch: its thread count is read only when the bench has imported it.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
#: a folder to write the records into instead of bench/results/ (tests)
RESULTS_ENV = "AGENTGYM_BENCH_RESULTS"
#: the tag of a smoke run (git-ignored)
SMOKE_TAG = "smoke"
#: bump when a field changes meaning
SCHEMA = 1
#: records are committed: one above this size gets a warning
MAX_BYTES = 1 << 20
#: the fields every record has (tests/bench/test_results_io.py)
FIELDS = ("schema", "bench", "tag", "date", "started", "wall_s", "command", "config", "git", "machine",
          "load", "repeats", "results")
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma", "neon", "asimd")
_PACKAGES = ("torch", "transformers", "deepspeed", "accelerate", "pyarrow", "prefect", "mlflow", "ray",
             "vllm", "trl", "peft")


def results_dir() -> Path:
    """Where records go: ``$AGENTGYM_BENCH_RESULTS`` or bench/results/."""
    return Path(os.environ.get(RESULTS_ENV) or RESULTS)


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def git_state(root: Path = ROOT) -> dict[str, Any]:
    """The commit checked out and whether tracked files differ from it (``dirty``, and which)."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    changed = [line[3:] for line in (status or "").splitlines() if line.strip()]
    return {"commit": commit.strip() if commit else None, "dirty": bool(changed) if status is not None else None,
            "changed": changed[:50]}


def _cpuinfo() -> tuple[str, list[str]]:
    model, flags = platform.processor() or platform.machine(), []
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "Hardware") and value.strip():
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            have = set(value.split())
            flags = [f for f in _CPU_FLAGS if f in have]
    return model, flags


def _ram_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 2)
    except OSError:
        pass
    return None


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in _PACKAGES:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def machine() -> dict[str, Any]:
    """What the numbers ran on: CPU, cores, RAM, threads, scheduling, software."""
    model, flags = _cpuinfo()
    torch = sys.modules.get("torch")
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    gpu = None
    if torch is not None:
        try:
            if torch.cuda.is_available():
                gpu = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        except Exception:  # noqa: BLE001 - a broken CUDA set-up is not the bench's concern here
            gpu = None
    return {
        "cpu_model": model, "cpu_flags": flags, "cores": os.cpu_count(), "usable_cores": usable,
        "ram_gib": _ram_gib(), "torch_threads": torch.get_num_threads() if torch is not None else None,
        "gpu": gpu, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "nice": os.nice(0),
        "python": sys.version.split()[0], "platform": platform.platform(), "versions": _versions(),
    }


def add_tag_argument(parser: Any) -> None:
    """``--tag``: the name of the record (an ``argparse`` parser's option)."""
    parser.add_argument("--tag", default="", help="the record's name: bench/results/<bench>-<tag>.json (default: "
                        "the UTC time; a smoke run's is 'smoke', git-ignored)")


def default_tag(config: Any = None) -> str:
    """The config's ``tag`` if it has one, else the UTC time; ``-smoke`` after it (or ``smoke``
    alone) when the config says it is a smoke run (``quick`` / ``smoke`` true)."""
    c = _as_dict(config)
    tag = c.get("tag") or None
    if c.get("smoke") or c.get("quick"):
        return f"{tag}-{SMOKE_TAG}" if tag else SMOKE_TAG
    return tag or datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def record_path(bench: str, tag: str | None) -> Path:
    """``<results_dir>/<bench>-<tag>.json`` (``<bench>.json`` without a tag)."""
    for part in (bench, tag or "x"):
        if not _TAG.match(part):
            raise ValueError(f"bench names and tags are letters, digits, '.', '_' and '-': {part!r}")
    return results_dir() / (f"{bench}-{tag}.json" if tag else f"{bench}.json")


def _as_dict(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config)
    return dict(vars(config))


class Run:
    """A bench run being recorded: made at the start (load, time), written at the end.

        run = results_io.Run("store_throughput", args)
        ...                                   # the measurements
        run.write(repeats=[...], results={...})
    """

    def __init__(self, bench: str, config: Any = None, load_start: tuple[float, ...] | None = None):
        self.bench = bench
        self.config = config
        self.load_start = list(load_start) if load_start is not None else list(os.getloadavg())
        self.started = utc_now()
        self.t0 = time.monotonic()

    def write(self, repeats: list[Any], results: Any = None, tag: str | None = None,
              extra: dict[str, Any] | None = None, out: str | Path | None = None) -> Path:
        """Write the record; returns its path. ``tag``: None for ``default_tag``, "" for none
        (``<bench>.json``); ``out``: an explicit path instead of ``record_path``."""
        config = _as_dict(self.config)
        if tag is None:
            tag = default_tag(config)
        path = Path(out) if out is not None else record_path(self.bench, tag)
        rec: dict[str, Any] = {
            "schema": SCHEMA, "bench": self.bench, "tag": tag, "date": utc_now(), "started": self.started,
            "wall_s": round(time.monotonic() - self.t0, 3),
            "command": _command(),
            "config": config, "git": git_state(), "machine": machine(),
            "load": {"start": self.load_start, "end": list(os.getloadavg())},
            "repeats": repeats, "results": results,
        }
        clash = set(rec) & set(extra or {})
        if clash:
            raise ValueError(f"extra fields {sorted(clash)} would replace the record's own")
        rec.update(extra or {})
        # strict JSON (jq, JavaScript, pandas' ujson): a NaN or infinity is written as null
        plain = _finite(json.loads(json.dumps(rec, default=_default)))
        text = json.dumps(plain, indent=1, allow_nan=False) + "\n"
        if len(text) > MAX_BYTES:  # a record is committed: raw numbers, not data sets
            print(f"warning: the {self.bench} record is {len(text) / 2**20:.1f} MiB (> {MAX_BYTES / 2**20:.0f} MiB): "
                  "keep bulky data out of it", file=sys.stderr)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path


def write_record(bench: str, config: Any, repeats: list[Any], results: Any = None, *, tag: str | None = None,
                 load_start: tuple[float, ...] | None = None, extra: dict[str, Any] | None = None,
                 out: str | Path | None = None) -> Path:
    """A one-call ``Run(bench, config, load_start).write(...)`` for a bench that kept its start load."""
    return Run(bench, config, load_start).write(repeats, results, tag=tag, extra=extra, out=out)


def _command() -> str:
    """The command line, the script's path relative to the repository where it is inside it."""
    argv = list(sys.argv)
    if argv and argv[0]:
        try:
            argv[0] = str(Path(argv[0]).resolve().relative_to(ROOT))
        except ValueError:
            pass
    return " ".join(["python", *argv])


def _finite(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float replaced by None (JSON has no such numbers)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def _default(obj: Any) -> Any:
    """JSON for what benches keep: paths, dataclasses, numpy scalars, tuples as keys' values."""
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        try:
            return obj.item()
        except (TypeError, ValueError):
            pass
    if hasattr(obj, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=str)
    return str(obj)
