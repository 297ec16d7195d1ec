"""What every ``agentgym`` command shares: the error console, a quiet, local environment, and the
temporary Prefect server of a command that runs a flow."""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

console = Console(stderr=True)

# Quiet, local-by-default Prefect: a temporary server (SQLite) when none is configured.
PREFECT_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_LOGGING_LEVEL": "CRITICAL",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "PREFECT_LOGGING_LOG_PRINTS": "false",
}


def quiet_env() -> None:
    """Set the defaults above and silence library chatter; a variable already set wins.
    Called at the start of a command, before Prefect, MLflow or transformers are imported."""
    for k, v in PREFECT_DEFAULTS.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not has_cuda() else "cuda")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded at run time
    for name in ("DeepSpeed", "deepspeed", "httpx", "alembic", "mlflow", "mlflow.store.db.utils"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class TemporaryPrefectServer:
    """The Prefect server of one command, where none is configured: the API Prefect's ephemeral
    mode would start (the same app, ``prefect.server.api.server:create_app``, on 127.0.0.1, with
    Prefect's ephemeral settings: no UI, the ephemeral set of services), but tied to this process.

    Prefect's own ephemeral server is a plain child process: when the command is killed (SIGKILL,
    the OOM killer) it lives on, orphaned, and a resumed run starts another. This one gets SIGTERM
    from the kernel when the thread that started it ends (``prctl(PR_SET_PDEATHSIG)`` in the child
    before it execs; start it from the main thread, which lives as long as the process), and is
    stopped at a normal exit. ``PREFECT_API_URL`` points this process (and what it starts) at it;
    ``tasks.links.TEMPORARY_SERVER_ENV`` marks it as temporary, so no MLflow run links its pages.
    """

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.api_url = ""

    @classmethod
    def needed(cls) -> bool:
        """Whether Prefect would start its ephemeral server: no API URL configured (environment,
        profile, prefect.toml) and ephemeral mode allowed."""
        from prefect.settings import get_current_settings

        settings = get_current_settings()
        return not settings.api.url and settings.server.ephemeral.enabled

    def start(self) -> None:
        """Start the server (returns at once; :meth:`wait` for it) and point Prefect at it."""
        self.port = _free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.process = self._spawn()
        atexit.register(self.stop)  # registered before Prefect's own exit hooks: runs after them
        from tasks.links import TEMPORARY_SERVER_ENV

        os.environ["PREFECT_API_URL"] = self.api_url
        os.environ["PREFECT_UI_URL"] = ""  # it serves no UI: Prefect's logs give no "View at" link
        os.environ[TEMPORARY_SERVER_ENV] = self.api_url
        import prefect.context

        prefect.context.refresh_global_settings_context()  # settings are read from the environment

    def _spawn(self) -> subprocess.Popen[bytes]:
        spec = importlib.util.find_spec("prefect")
        assert spec is not None and spec.origin is not None
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
               "PREFECT__SERVER_FINAL": "1"}
        from tasks.links import TEMPORARY_SERVER_ENV

        for own in ("PREFECT_API_URL", "PREFECT_UI_URL", TEMPORARY_SERVER_ENV):  # set by a first start
            env.pop(own, None)
        return subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(spec.origin).parent.parent),
             "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "error", "--lifespan", "on"],
            env=env, stdin=subprocess.DEVNULL, preexec_fn=_die_with(os.getpid()))

    def wait(self, timeout: float | None = None) -> None:
        """Block until the server answers /health (a port taken meanwhile: start again on another)."""
        import httpx

        timeout = timeout or float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", 90))
        deadline = time.monotonic() + timeout
        with httpx.Client() as client:
            while True:
                assert self.process is not None
                code = self.process.poll()
                if code == 3:  # uvicorn could not bind the port
                    self.stop()
                    self.start()
                elif code is not None:
                    raise RuntimeError(f"the temporary Prefect server exited with code {code} before it "
                                       f"answered at {self.api_url}")
                try:
                    if client.get(f"{self.api_url}/health", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the temporary Prefect server did not answer at {self.api_url} "
                                       f"within {timeout:.0f} s")
                time.sleep(0.1)

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


def prefect_server() -> TemporaryPrefectServer | None:
    """For a command that runs a Prefect flow: the configured Prefect server (None), or a
    :class:`TemporaryPrefectServer` started now (``.wait()`` before the first flow)."""
    if not TemporaryPrefectServer.needed():
        return None
    server = TemporaryPrefectServer()
    server.start()
    return server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with(parent: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGTERM when its parent (thread) dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the forked child

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os._exit(1)

    return preexec
