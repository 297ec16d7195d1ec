"""What every bench script shares: the result table, the JSON record, the scripted engine.

Scripts run as ``python bench/<name>.py``, so this folder is on ``sys.path`` and they import it
as ``benchlib``. Each script prints ``metric | ours | baseline | ratio | target | met`` and
writes its record, ``bench/results/<name>-<tag>.json`` (``results_io``: committed; config,
commit, machine, load at start and end, every repeat's raw numbers): these machines are shared,
and a ratio means little without the load it was measured under.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import results_io

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


@dataclass
class Row:
    """One line of the result table. ``ratio`` is ours / baseline when both are throughputs
    (higher is better), unless ``ratio`` is given; ``target`` is ``(op, value)`` with op '>=' or
    '<=', or None for a figure reported without a target."""

    metric: str
    ours: float
    baseline: float | None = None
    ratio: float | None = None
    target: tuple[str, float] | None = None
    unit: str = ""

    def __post_init__(self) -> None:
        if self.ratio is None and self.baseline:
            self.ratio = self.ours / self.baseline

    @property
    def met(self) -> bool | None:
        if self.target is None or self.ratio is None:
            return None
        op, value = self.target
        return self.ratio >= value if op == ">=" else self.ratio <= value

    def as_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "ours": self.ours, "baseline": self.baseline, "ratio": self.ratio,
                "target": f"{self.target[0]} {self.target[1]}" if self.target else None,
                "met": self.met, "unit": self.unit}


def set_preimport_env(threads: int) -> None:
    """What a bench sets before torch / vllm are imported: ``threads`` OpenMP threads, vLLM in
    this process, no core pinning, quiet logs (a value already in the environment wins)."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def print_table(rows: list[Row], title: str = "") -> None:
    if title:
        print(f"\n{title}")
    cells = [("metric", "ours", "baseline", "ratio", "target", "met")]
    for r in rows:
        target = f"{r.target[0]} {r.target[1]:g}" if r.target else "-"
        met = {None: "-", True: "yes", False: "NO"}[r.met]
        cells.append((r.metric + (f" [{r.unit}]" if r.unit else ""), _num(r.ours), _num(r.baseline),
                      f"{r.ratio:.3f}" if r.ratio is not None else "-", target, met))
    widths = [max(len(c[i]) for c in cells) for i in range(6)]
    for j, c in enumerate(cells):
        print(" | ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(c, widths))))
        if j == 0:
            print("-+-".join("-" * w for w in widths))


def environment() -> dict[str, Any]:
    """Load average, threads and versions: what a timing needs beside it to be read (the
    ``machine`` of a record, ``results_io.machine``, has these and more)."""
    import torch

    versions = {}
    for pkg in ("torch", "transformers", "deepspeed", "pyarrow", "prefect", "mlflow", "vllm", "trl"):
        try:
            from importlib.metadata import version

            versions[pkg] = version(pkg)
        except Exception:  # noqa: BLE001 - not installed in this venv
            pass
    return {"loadavg": os.getloadavg(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": sys.version.split()[0], "platform": platform.platform(), "versions": versions,
            "nice": os.nice(0)}


def start(name: str, args: Any) -> results_io.Run:
    """The record of this run, begun now (load average and time at start): call it before the
    measurements, and ``write_results`` with it after them."""
    return results_io.Run(name, args)


def write_results(run: results_io.Run, rows: list[Row], repeats: list[Any], summary: dict[str, Any] | None = None,
                  tag: str | None = None) -> Path:
    """``bench/results/<name>-<tag>.json`` (``results_io``): config, commit, machine, load at start and
    end, ``repeats`` (every measured repeat's raw numbers) and as results the table's rows plus
    ``summary``."""
    out = run.write(repeats, {"rows": [r.as_dict() for r in rows], **(summary or {})}, tag=tag)
    la, lb = os.getloadavg(), run.load_start
    try:
        shown = out.relative_to(ROOT)
    except ValueError:
        shown = out
    print(f"\nload average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f} (start: {' '.join(f'{x:.2f}' for x in lb)}); "
          f"results: {shown}")
    return out


def load_tests_module(name: str):
    """A module of tests/ loaded by path (``scripted_engine``, ``seaweed``): putting tests/ on
    sys.path would let tests/env_adapters shadow the env_adapters package."""
    path = ROOT / "tests" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


class Timer:
    """``with Timer() as t: ...`` then ``t.s``."""

    def __enter__(self) -> "Timer":
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.s = time.perf_counter() - self.t0


def sleep_env_class():
    """``SleepEnv``: answers every step after ``latency_ms`` of sleep (an environment that waits
    on a simulator or a server), never ends by itself. Registered as adapter ``sleep`` so the
    project's HTTP env server can serve it (``register_sleep_env``)."""
    from env_adapters.base import StepResult, TextEnv

    class SleepEnv(TextEnv):
        name = "sleep"

        def __init__(self, latency_ms: float = 50.0):
            self.latency_s = latency_ms / 1000.0

        def reset(self, task_id: int, seed: int = 0):
            return f"Task {task_id}: say anything.", {}

        def step(self, action_text: str):
            time.sleep(self.latency_s)
            return StepResult("Nothing happens.", 0.0, False)

    return SleepEnv


SleepEnv = None  # set on first use: env_adapters is imported lazily


def register_sleep_env() -> None:
    """Make ``make_env("sleep", latency_ms=...)`` and ``create_app("sleep", ...)`` work."""
    global SleepEnv
    import env_adapters

    if SleepEnv is None:
        SleepEnv = sleep_env_class()
    env_adapters.ADAPTERS["sleep"] = "benchlib:SleepEnv"
