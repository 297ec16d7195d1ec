"""What every ``agentgym`` command shares: the error console and a quiet, local environment."""

from __future__ import annotations

import logging
import os

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
