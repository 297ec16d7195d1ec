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


def get_session(config: PipelineConfig | None, run_id: str, weights: str | Path | None = None,
                create: bool = False) -> PolicySession:
    """The run's live session. Only ``restore_policy`` creates one (``create=True``, from the
    run's latest checkpoint): a task that finds none fails instead of silently starting over
    from the base model."""
    with _lock:
        session = _sessions.get(run_id)
        if session is None:
            if not create or config is None:
                raise RuntimeError(
                    f"no live policy session for run {run_id!r} in this process (it was dropped "
                    "after a failure, or the flow did not start with restore_policy): re-run the "
                    "pipeline with the same run id to resume from its latest checkpoint")
            session = PolicySession(config, run_id, weights=weights)
            _sessions[run_id] = session
        elif config is not None and config != session.cfg:
            changed = sorted(k for k, v in config.model_dump().items() if v != session.cfg.model_dump().get(k))
            raise ValueError(
                f"run {run_id!r} has a live policy session built from another config (differs in "
                f"{', '.join(changed) or 'nested fields'}); one run trains one config: start it under a "
                "new run id, or drop the session first (tasks.runtime.drop_session)")
        return session


def drop_session(run_id: str) -> None:
    """Forget the run's session and release it (Ray rank actors and rollout workers stop)."""
    with _lock:
        session = _sessions.pop(run_id, None)
    if session is not None:
        session.close()
