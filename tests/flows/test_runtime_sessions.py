"""tasks.runtime: one live session per run id, and it is never reused under another config."""

from types import SimpleNamespace

import pytest

from agentgym.config import PipelineConfig
from tasks import runtime


def test_a_changed_config_is_refused_not_ignored(monkeypatch):
    cfg = PipelineConfig(seed=1)
    fake = SimpleNamespace(cfg=cfg, close=lambda: None)
    monkeypatch.setitem(runtime._sessions, "run-a", fake)
    assert runtime.get_session(cfg, "run-a") is fake
    assert runtime.get_session(PipelineConfig(seed=1), "run-a") is fake  # equal, not the same object
    assert runtime.get_session(None, "run-a") is fake
    with pytest.raises(ValueError, match=r"another config \(differs in seed\).*new run id"):
        runtime.get_session(PipelineConfig(seed=2), "run-a")


def test_no_session_is_an_error_unless_created():
    with pytest.raises(RuntimeError, match="no live policy session"):
        runtime.get_session(PipelineConfig(), "never-started")
