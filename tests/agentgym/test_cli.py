"""`agentgym env serve NAME --port P` as a real process: it answers /health, serves an episode
to the project's HTTP client, and shuts down gracefully on Ctrl+C (SIGINT) or SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from env_adapters.http_client import HTTPEnv
from env_adapters.keyword import KeywordEnv

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _default_sigint() -> None:
    # A child inherits an ignored SIGINT (e.g. from a background job); give it the default
    # disposition, as in a terminal, so that SIGINT is a real Ctrl+C.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("launcher, sig, exit_codes", [
    # the installed console script; Ctrl+C: uvicorn shuts down and the command exits 0
    ("script", signal.SIGINT, {0}),
    # python -m agentgym_cli.cli; SIGTERM: uvicorn shuts down gracefully, then re-raises the signal
    # with its default action (as uvicorn does since 0.29), so -SIGTERM (or 0) is clean
    ("module", signal.SIGTERM, {0, -signal.SIGTERM}),
])
def test_env_serve_runs_an_episode_and_exits_cleanly(tmp_path, launcher, sig, exit_codes):
    port = _free_port()
    if launcher == "script":
        script = Path(sys.executable).parent / "agentgym"
        assert script.exists(), f"no `agentgym` console script next to {sys.executable}"
        cmd = [str(script)]
    else:
        cmd = [sys.executable, "-m", "agentgym_cli.cli"]
    cmd += ["env", "serve", "keyword", "--port", str(port), "--max-envs", "3"]
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=_default_sigint)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"the server exited early:\n{log_path.read_text()}"
            try:
                health = httpx.get(f"{url}/health", timeout=2).json()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, f"no /health:\n{log_path.read_text()}"
                time.sleep(0.1)
        assert health["status"] == "ok" and health["env"] == "keyword"
        assert health["max_envs"] == 3 and health["envs"] == 0  # --max-envs reached the server

        env = HTTPEnv(url, "keyword", timeout_s=10, retries=0)
        try:
            obs, info = env.reset(4)
            assert obs == "Task 4: reply with the word 'yes'." and info["task_id"] == 4
            assert env.system_prompt() == KeywordEnv().system_prompt()
            assert env.health()["envs"] == 1
            r = env.step("Thought: hm\nAction: no")
            assert (r.reward, r.terminated, r.truncated) == (0.0, False, False)
            assert r.observation == "Wrong. Task 4: reply with the word 'yes'."
            r = env.step("Action: yes")
            assert (r.reward, r.terminated) == (1.0, True) and r.info["success"] is True
        finally:
            env.close()
        assert httpx.get(f"{url}/health", timeout=2).json()["envs"] == 0

        proc.send_signal(sig)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:  # only on a failure above
            proc.kill()
            proc.wait(timeout=10)
    out = log_path.read_text()
    assert rc in exit_codes, f"exit code {rc}:\n{out}"
    assert "Application shutdown complete." in out and "Finished server process" in out, out
    assert "Traceback" not in out and "ERROR" not in out, out
    with pytest.raises(httpx.ConnectError):  # the port is released
        httpx.get(f"{url}/health", timeout=2)
