"""Fixtures of the GPU checks (tests/gpu; skipped without CUDA by tests/conftest.py)."""

import pytest


@pytest.fixture(scope="session")
def tiny_gpu_path(tmp_path_factory):
    from agentgym.models.folders import build_tiny_model

    # head_dim 64: the sizes every vLLM attention backend takes
    return build_tiny_model(tmp_path_factory.mktemp("gpu-models") / "tiny-hd64",
                            hidden_size=256, heads=4, kv_heads=2, layers=2)
