"""Fixtures shared by the vLLM engine tests (run in .venv-vllm)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def hd32_path(tmp_path_factory):
    """The tiny model with head_dim 32 (vLLM's CPU attention does not take the default 16)."""
    from agentgym.models.folders import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-hd32", hidden_size=64, heads=2, kv_heads=1)
