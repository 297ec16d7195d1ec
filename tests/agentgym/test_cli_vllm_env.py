"""`agentgym train` with `rollout.engine: vllm` from the main environment (no vllm) re-runs
itself, same arguments, in the vLLM environment; any other engine runs where it is."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                                reason="this interpreter has vllm: nothing to re-run elsewhere")


@pytest.fixture
def fake_vllm_python(tmp_path):
    """An executable standing in for .venv-vllm/bin/python: records its arguments, exits 7."""
    record = tmp_path / "argv.txt"
    exe = tmp_path / "python"
    exe.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}\nexit 7\n')
    exe.chmod(0o755)
    return exe, record


def _train(python: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "AGENTGYM_VLLM_PYTHON": str(python)}
    return subprocess.run([sys.executable, "-m", "agentgym_cli.cli", "train", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_vllm_engine_reruns_the_same_command_in_the_vllm_environment(fake_vllm_python):
    exe, record = fake_vllm_python
    # constrained decoding is the hf engine's: the vLLM run decodes freely
    args = ["-c", "configs/babyai.yaml", "--set", "rollout.engine=vllm", "--set", "rollout.constrain_actions=false",
            "--set", "rollout.action_logprob=policy", "--set", "rollout.action_temperature=1", "--run-id", "r1"]
    done = _train(exe, *args)
    assert done.returncode == 7, done.stderr  # the vLLM interpreter's exit status
    assert record.read_text().split("\n")[:-1] == ["-m", "agentgym_cli.cli", "train", *args]
    assert "running in the vLLM environment" in done.stdout + done.stderr


def test_other_engines_run_here(fake_vllm_python):
    exe, record = fake_vllm_python
    # an invalid field makes the run stop at the config check, here, with its own message
    done = _train(exe, "-c", "configs/babyai.yaml", "--set", "rollout.engine=hf", "--set", "rollout.group_size=0")
    assert done.returncode == 2
    assert "group_size" in done.stdout + done.stderr
    assert not record.exists()
