"""A real local Prefect server + `process` worker, started with deployments/local.sh on a free port.

Everything lives in a temporary folder: the server's SQLite DB, logs and pids (AGENTGYM_STATE_DIR),
the Prefect profiles (PREFECT_HOME), the config files the deployments get (AGENTGYM_CONFIG_DIR).
The pytest process itself keeps its own temporary Prefect server: this stack is only reached
through subprocesses and :meth:`LocalStack.client`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

import configs  # tests/ is on sys.path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deployments" / "local.sh"
PREFECT = ROOT / ".venv" / "bin" / "prefect"
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_config(tmp: Path, model_cache: str, experiment: str, **extra: Any) -> dict[str, Any]:
    """A config that trains in seconds (tests/configs.py's) on the keyword task with held-out
    tasks, its store and MLflow under ``tmp``; ``extra`` replaces whole top-level fields."""
    cfg = configs.tiny_config(
        model_cache, store_root=tmp / "store", tracking_dir=tmp,
        envs=[{"name": "keyword", "tasks": [0, 1, 2, 3], "eval_tasks": [10, 11, 12],
               "kwargs": {"target": "yes", "mode": "starts_with"}}],
        rollout={"max_context_tokens": 512}, algorithm={"skip_tied_groups": False}, trainer={"micro_batch_size": 4},
        tracking={"experiment": experiment})
    cfg.update(extra)
    own_artifact_root(cfg["tracking"]["tracking_uri"], experiment, tmp / "mlartifacts")
    return cfg


def own_artifact_root(tracking_uri: str, experiment: str, root: Path) -> None:
    """Create the experiment with its artifacts under ``root`` (a sqlite store's default artifact
    root is ./mlruns of the working directory: the repository, for flow runs of the worker)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    if client.get_experiment_by_name(experiment) is None:
        root.mkdir(parents=True, exist_ok=True)
        client.create_experiment(experiment, artifact_location=root.as_uri())


class LocalStack:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.state = tmp / "state"
        self.configs = tmp / "configs"
        self.configs.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
        env.update({
            "PREFECT_HOME": str(tmp / "prefect-home"),  # profiles: `start` activates agentgym-local here
            "AGENTGYM_STATE_DIR": str(self.state),
            "AGENTGYM_PREFECT_PORT": str(self.port),
            "AGENTGYM_CONFIG_DIR": str(self.configs),
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            "PREFECT_LOGGING_LEVEL": "INFO",
            "OMP_NUM_THREADS": "1",  # flow runs share 2 cores with pytest and other work
            "PYTHONUNBUFFERED": "1",
        })
        self.env = env
        self.timings: dict[str, float] = {}

    # -- processes -------------------------------------------------------------------------
    def sh(self, *args: str, timeout: float = 240, check: bool = True, **env: str) -> subprocess.CompletedProcess:
        out = subprocess.run([str(SCRIPT), *args], env={**self.env, **env}, cwd=self.tmp, text=True,
                             capture_output=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"local.sh {' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
                                 f"\n--- worker log ---\n{self.log('worker')}")
        return out

    def prefect(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        """The `prefect` CLI as a user types it: no PREFECT_API_URL, only the active profile."""
        out = subprocess.run([str(PREFECT), *args], env=self.env, cwd=self.tmp, text=True,
                             capture_output=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"prefect {' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        return out

    def log(self, name: str, lines: int = 60) -> str:
        f = self.state / f"{name}.log"
        return "\n".join(f.read_text().splitlines()[-lines:]) if f.exists() else ""

    def start(self) -> None:
        t0 = time.perf_counter()
        out = self.sh("start")
        self.timings["start_s"] = time.perf_counter() - t0  # server + worker online + profile
        m = re.search(r"server up at \S+ in (\d+) s", out.stdout)
        if m:
            self.timings["server_start_s"] = float(m.group(1))

    def stop(self) -> None:
        self.sh("stop", check=False, timeout=120)

    # -- deployments -----------------------------------------------------------------------
    def write_config(self, name: str, cfg: dict[str, Any]) -> Path:
        path = self.configs / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

    def prefect_file(self, edit=None) -> Path:
        """A copy of deployments/prefect.yaml, optionally edited (``edit(spec) -> None``)."""
        spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
        if edit:
            edit(spec)
        path = self.tmp / f"prefect-{time.monotonic_ns()}.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        return path

    def deploy(self, prefect_file: Path | None = None, *names: str) -> subprocess.CompletedProcess:
        args = ["deploy"] + [a for n in names for a in ("--name", n)]
        extra = {"AGENTGYM_PREFECT_FILE": str(prefect_file)} if prefect_file else {}
        return self.sh(*args, **extra)

    def run_deployment(self, name: str, *params: str) -> str:
        """`prefect deployment run NAME --param ...`; returns the flow run id."""
        args = ["deployment", "run", name]
        for p in params:
            args += ["--param", p]
        out = self.prefect(*args)
        m = re.search(r"UUID: ([0-9a-f-]{36})", out.stdout)
        assert m, out.stdout
        return m.group(1)

    # -- API -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def client(self):
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: self.api}):
            with get_client(sync_client=True) as client:
                yield client

    def wait_flow_run(self, flow_run_id: str, timeout: float = 180):
        deadline = time.monotonic() + timeout
        while True:
            with self.client() as c:
                run = c.read_flow_run(flow_run_id)
            if run.state and run.state.type.value in TERMINAL:
                return run
            if time.monotonic() > deadline:
                raise AssertionError(f"flow run {flow_run_id} still {run.state.type.value if run.state else None} "
                                     f"after {timeout} s\n--- worker log ---\n{self.log('worker')}")
            time.sleep(2)

    def first_task_start(self, flow_run_id: str, prefix: str):
        """Start time of the first task run named ``prefix*`` in the flow run or its subflows."""
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId

        with self.client() as c:
            ids = [flow_run_id]
            frontier = [flow_run_id]
            while frontier:
                subs = c.read_flow_runs(flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=frontier)))
                frontier = [str(s.id) for s in subs]
                ids += frontier
            tasks = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))
        starts = [t.start_time for t in tasks if t.name.startswith(prefix) and t.start_time]
        return min(starts) if starts else None

    def record(self, path: Path) -> None:
        path.write_text(json.dumps(self.timings, indent=2))
