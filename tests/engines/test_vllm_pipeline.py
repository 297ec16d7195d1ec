"""The whole ScalingInter-RL flow with `rollout.engine: vllm`, by changing the config only.

Runs in .venv-vllm (see tests/engines/test_vllm.py); skipped where vllm is not installed.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import pytest  # noqa: E402

pytest.importorskip("vllm", reason="vLLM runs in .venv-vllm (bash scripts/setup_vllm_env.sh)")

import pandas as pd  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from agentgym.config import parse_config  # noqa: E402
from agentgym.models.folders import build_tiny_model  # noqa: E402


def test_quickstart_shape_runs_with_vllm(tmp_path):
    # vLLM's CPU attention needs head_dim >= 32: the tiny model built with 2 heads of 32
    base = build_tiny_model(tmp_path / "tiny-hd32", hidden_size=64, heads=2, kv_heads=1)
    from flows.train import scaling_inter_rl

    cfg = parse_config({
        "run_id": "vllm-flow", "seed": 0,
        "model": {"name_or_path": str(base), "dtype": "float32"},
        "envs": [{"name": "keyword", "tasks": [0, 1, 2], "kwargs": {"target": "aeiou", "mode": "char_share"}},
                 {"name": "keyword", "tasks": [3, 4], "kwargs": {"target": "yes"}}],
        "rollout": {"engine": "vllm", "tasks_per_iteration": 4, "group_size": 2, "max_new_tokens": 6},
        "trainer": {"learning_rate": 1e-3, "bf16": False},
        "schedule": {"stages": [{"horizon": 1, "iterations": 2}, {"horizon": 2, "iterations": 1}]},
        "store": {"root": str(tmp_path / "store")},
        "tracking": {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "vllm"},
    })
    result = scaling_inter_rl(cfg)
    episodes = pd.read_parquet(f"{result['store']}/episodes")
    assert len(episodes) == 3 * 4 * 2
    assert episodes.groupby(episodes["stage"].astype(int))["horizon"].first().to_dict() == {0: 1, 1: 2}
    ckpt = result["stages"][-1]["checkpoint"].replace("file://", "")
    trained = AutoModelForCausalLM.from_pretrained(ckpt)
    start = AutoModelForCausalLM.from_pretrained(base)
    assert any(not torch.equal(a, b) for a, b in zip(trained.state_dict().values(), start.state_dict().values()))
    # the policy versions recorded with the episodes advance as vLLM gets the new weights
    assert episodes["policy_version"].max() >= 2
