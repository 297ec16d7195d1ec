"""Process-local sessions: the models and engines that stay in memory between tasks.

Prefect runs a flow's tasks in threads of the flow's process, so the policy, the inference
engine and the DeepSpeed trainer live here, keyed by pipeline run id, instead of being
reloaded from disk by every task. A fresh process (a retry, a resumed run) rebuilds the
session from the run's latest checkpoint.
"""

from __future__ import annotations

import threading
from pathlib import Path

from agentgym.config import PipelineConfig
from agentgym.pipeline import PolicySession

_sessions: dict[str, PolicySession] = {}
_lock = threading.Lock()


def get_session(config: PipelineConfig, run_id: str, weights: str | Path | None = None) -> PolicySession:
    with _lock:
        session = _sessions.get(run_id)
        if session is None:
            session = PolicySession(config, run_id, weights=weights)
            _sessions[run_id] = session
        return session


def drop_session(run_id: str) -> None:
    with _lock:
        _sessions.pop(run_id, None)
