"""Start and stop a ``vllm serve`` process set up as ``rollout.engine: vllm_server`` needs it.

Two uses:

* ``python -m agentgym.rollout.engines.vllm_server_launch MODEL [vllm serve options]`` (from the env
  that has vllm, e.g. ``.venv-vllm/bin/python``) is ``vllm serve MODEL ...`` with the project's
  sampler patch applied in every process of the server. vLLM's CPU backend starts its engine
  core with ``spawn``, so a patch made in the parent would not reach it; a spawned child imports
  the parent's ``__main__`` module (this one, as ``__mp_main__``), and the module applies the
  patch on that import. With the patch the returned log-probs are ``log_softmax(logits / T)``
  before top-k/top-p truncation (see ``engines/vllm.py``), which greedy decoding at T != 1 and
  ``top_p < 1`` need. Give ``--logprobs-mode processed_logprobs`` and ``--generation-config
  vllm`` (:func:`serve_args` lists what the engine relies on).
* :func:`start_vllm_server` (tests, docs, local runs) starts that command on a free loopback
  port, waits for ``/health`` and returns a handle whose ``stop()`` ends the process group.

This module imports no vllm at import time: the main env (no vllm) imports it to start a server
from another interpreter.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

import agentgym

REPO = agentgym.PACKAGE_ROOT


def vllm_python() -> str:
    """The interpreter that has vllm: ``$AGENTGYM_VLLM_PYTHON`` if set, this one if it has
    vllm, else the repo's ``.venv-vllm``."""
    import importlib.util

    if os.environ.get("AGENTGYM_VLLM_PYTHON"):
        return os.environ["AGENTGYM_VLLM_PYTHON"]
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    candidate = REPO / ".venv-vllm" / "bin" / "python"
    if not candidate.exists():  # a git worktree: the env lives beside the main checkout
        with contextlib.suppress(Exception):
            common = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--git-common-dir"],
                                    capture_output=True, text=True, check=True).stdout.strip()
            candidate = (REPO / common).resolve().parent / ".venv-vllm" / "bin" / "python"
    if not candidate.exists():
        raise FileNotFoundError("no Python with vllm: run `bash scripts/setup_vllm_env.sh` (creates .venv-vllm)")
    return str(candidate)


def serve_args(*, lora_rank: int | None, dtype: str = "float32", max_model_len: int = 1024,
               served_model_name: str | None = None, max_loras: int = 2) -> list[str]:
    """The ``vllm serve`` options the vllm_server engine relies on.

    ``--logprobs-mode processed_logprobs``: log-probs after temperature (what the trainer
    recomputes); ``--generation-config vllm``: no sampling defaults or extra stop ids taken from
    the model's generation_config.json (the engine sends every setting itself); LoRA: runtime
    loading needs ``--enable-lora`` and a ``--max-lora-rank`` at least the adapters' rank (and
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` in the server's environment). ``max_loras`` 2:
    the new adapter is loaded before the old one is unloaded.
    """
    args = ["--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager",
            "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
            "--enable-prefix-caching", "--disable-log-stats"]
    if served_model_name:
        args += ["--served-model-name", served_model_name]
    if lora_rank:
        # vLLM accepts only its listed ranks (8, 16, 32, ...): round the adapter's up
        ranks = [1, 8, 16, 32, 64, 128, 256, 320, 512]
        rank = next((r for r in ranks if r >= lora_rank), lora_rank)
        args += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(max_loras)]
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VLLMServer:
    """A running ``vllm serve`` started by :func:`start_vllm_server`."""

    url: str
    proc: subprocess.Popen
    log_path: Path
    start_seconds: float = 0.0
    args: list[str] = field(default_factory=list)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group (the API server and its engine core): a crash."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=30)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``timeout_s``."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        # the engine core may outlive the API server: end the group either way
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def log_tail(self, n: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""


def start_vllm_server(model: str | Path, log_path: str | Path, *, port: int | None = None,
                      lora_rank: int | None = None, dtype: str = "float32", max_model_len: int = 1024,
                      kv_cache_gb: float = 0.25, served_model_name: str | None = None,
                      extra_args: list[str] | tuple[str, ...] = (), nice: int = 0,
                      timeout_s: float = 900.0, python: str | None = None) -> VLLMServer:
    """Start ``vllm serve model`` on 127.0.0.1 (through this module, so the sampler patch is
    on) and wait until ``GET /health`` answers 200. Raises ``RuntimeError`` with the log's
    tail if the process exits or ``timeout_s`` passes first (the server is stopped then)."""
    port = port or free_port()
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update({
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_CPU_OMP_THREADS_BIND": env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
        "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
    })
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its own engine core process
    args = [str(model), "--host", "127.0.0.1", "--port", str(port),
            *serve_args(lora_rank=lora_rank, dtype=dtype, max_model_len=max_model_len,
                        served_model_name=served_model_name),
            "--kv-cache-memory-bytes", str(int(kv_cache_gb * 2**30)), *extra_args]
    cmd = [python or vllm_python(), "-m", "agentgym.rollout.engines.vllm_server_launch", *args]
    if nice:
        cmd = ["nice", "-n", str(nice), *cmd]
    t0 = time.perf_counter()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
                                start_new_session=True)  # own process group: stop() ends all of it
    server = VLLMServer(f"http://127.0.0.1:{port}", proc, log_path, args=args)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode} while starting; log "
                               f"{log_path}:\n{server.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                break
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"vllm serve not healthy after {timeout_s:.0f} s; log {log_path}:\n"
                               f"{server.log_tail()}")
        time.sleep(1.0)
    server.start_seconds = time.perf_counter() - t0
    return server


def _patch_in_this_process() -> None:
    # engines/vllm.py defaults to an in-process engine core; a server keeps vLLM's own layout
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    import agentgym.rollout.engines.vllm  # noqa: F401  (its vLLM environment defaults: log level, no usage stats)
    from agentgym.patches.vllm import patch_cpu_seed_rewind, patch_sampler

    patch_sampler()
    patch_cpu_seed_rewind()


if __name__ == "__mp_main__":  # a child vLLM spawned from the launcher: the engine core
    _patch_in_this_process()


if __name__ == "__main__":
    from agentgym.patches.vllm import report_vllm_cpu_as_vllm

    _patch_in_this_process()
    report_vllm_cpu_as_vllm()  # vLLM's CLI asks the version of "vllm"; vllm-cpu is not named so
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    main()
