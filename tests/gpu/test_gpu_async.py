"""GPU check of asynchronous RL (rollout.async_steps: 1) at the library level: vLLM in-process
plays iteration i+1 in a thread while DeepSpeed updates on iteration i, on one CUDA GPU; the
weights reach vLLM only between rollouts. Run with ``bash tests/gpu/run_gpu_checks.sh``."""

from __future__ import annotations

import os
import threading

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest  # noqa: E402

pytestmark = pytest.mark.gpu


def test_rollout_overlaps_the_update_on_one_gpu(tmp_path, tiny_gpu_path):
    pytest.importorskip("vllm", reason="vllm (CUDA build) is not installed")
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    pytest.importorskip("pyarrow", reason="pyarrow is not installed (the trajectory store)")
    from agentgym.config import parse_config
    from agentgym.pipeline import IterationRef, PolicySession

    cfg = parse_config({
        "model": {"name_or_path": str(tiny_gpu_path), "dtype": "bfloat16"},
        "envs": [{"name": "keyword", "tasks": [0, 1, 2], "kwargs": {"target": "aeiou", "mode": "char_share"}}],
        "rollout": {"engine": "vllm", "tasks_per_iteration": 3, "group_size": 2, "max_new_tokens": 6,
                    "async_steps": 1},
        "trainer": {"learning_rate": 1e-3, "bf16": True},
        "algorithm": {"skip_tied_groups": False},
        "schedule": {"stages": [{"horizon": 1, "iterations": 3}]},
        "store": {"root": str(tmp_path / "store")},
    })
    session = PolicySession(cfg, "gpu-async")
    try:
        session.collect(IterationRef(0, 0, 0), 1)
        for it in range(3):
            ahead: dict = {}
            if it + 1 < 3:  # what the stage flow does: sync, start the next rollout, then update
                session.sync_if_behind()
                t = threading.Thread(target=lambda: ahead.update(session.collect(IterationRef(0, it + 1, it + 1), 1)))
                t.start()
            session.advantages(IterationRef(0, it, it))
            upd = session.update(IterationRef(0, it, it), sync=False)
            assert upd["staleness"] == (0 if it == 0 else 1)
            if it + 1 < 3:
                t.join()
                assert ahead["rows"] == 6
        versions = session.store.read_table("episodes").groupby("iteration")["policy_version"].max().to_dict()
        assert {int(k): int(v) for k, v in versions.items()} == {0: 0, 1: 0, 2: 1}
        assert session.policy_version == 3 and session.engine_version == 1
        assert session.sync_if_behind()["synced"] == 1.0 and session.engine_version == 3
    finally:
        session.close()
