"""GPU checks of asynchronous RL (rollout.async_steps: 1 and 2) at the library level: vLLM in-process
plays iterations i+1..i+k in a thread while DeepSpeed updates on iteration i, on one CUDA GPU;
the weights reach vLLM only between rollouts. ``play_k_ahead`` is the stage loop without Prefect
(any engine). Run with ``bash tests/gpu/run_gpu_checks.sh``."""

from __future__ import annotations

import os
import threading

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest  # noqa: E402

pytestmark = pytest.mark.gpu


def async_config(model_path, tmp_path, async_steps: int, iterations: int, engine: str = "vllm"):
    """The tiny model on ``engine`` and DeepSpeed in bf16, the keyword env, one stage at horizon 1."""
    from agentgym.config import parse_config

    return parse_config({
        "model": {"name_or_path": str(model_path), "dtype": "bfloat16"},
        "envs": [{"name": "keyword", "tasks": [0, 1, 2], "kwargs": {"target": "aeiou", "mode": "char_share"}}],
        "rollout": {"engine": engine, "tasks_per_iteration": 3, "group_size": 2, "max_new_tokens": 6,
                    "async_steps": async_steps},
        "trainer": {"learning_rate": 1e-3, "bf16": True},
        "algorithm": {"skip_tied_groups": False},
        "schedule": {"stages": [{"horizon": 1, "iterations": iterations}]},
        "store": {"root": str(tmp_path / "store")},
    })


def test_rollout_overlaps_the_update_on_one_gpu(tmp_path, tiny_gpu_path):
    pytest.importorskip("vllm", reason="vllm (CUDA build) is not installed")
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    pytest.importorskip("pyarrow", reason="pyarrow is not installed (the trajectory store)")
    from agentgym.pipeline import IterationRef, PolicySession

    cfg = async_config(tiny_gpu_path, tmp_path, async_steps=1, iterations=3)
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


def play_k_ahead(session, iterations: int, k: int) -> list[int]:
    """The stage loop of flows/train.py at the library level: iteration i's rollout was queued
    up to ``k`` iterations earlier; a worker thread plays the queued rollouts one after another,
    each after ``sync_if_behind(before_step=...)``, while the caller updates. Returns each
    update's staleness."""
    import queue

    from agentgym.pipeline import IterationRef

    todo: queue.Queue = queue.Queue()
    done = {it: threading.Event() for it in range(iterations)}
    errors: list[BaseException] = []

    def worker() -> None:
        while (nxt := todo.get()) is not None:
            try:
                session.sync_if_behind(before_step=nxt)
                session.collect(IterationRef(0, nxt, nxt), 1)
            except BaseException as e:  # noqa: BLE001 - reported by the caller
                errors.append(e)
            done[nxt].set()

    session.collect(IterationRef(0, 0, 0), 1)
    done[0].set()
    thread = threading.Thread(target=worker)
    thread.start()
    staleness, queued = [], 0
    try:
        for it in range(iterations):
            done[it].wait(timeout=600)
            assert not errors, errors
            for nxt in range(queued + 1, min(it + k, iterations - 1) + 1):  # queued >= it
                todo.put(nxt)
                queued = nxt
            session.advantages(IterationRef(0, it, it))
            staleness.append(session.update(IterationRef(0, it, it), sync=False)["staleness"])
    finally:
        todo.put(None)
        thread.join(timeout=600)
    return staleness


def test_two_rollouts_ahead_stay_within_the_bound_on_one_gpu(tmp_path, tiny_gpu_path):
    """async_steps 2: iterations i+1 and i+2 play on vLLM (one after another) while DeepSpeed
    updates on i; no update trains on episodes more than 2 updates old, and each queued rollout
    is sampled by a policy at most 2 updates older than its own step."""
    pytest.importorskip("vllm", reason="vllm (CUDA build) is not installed")
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    from agentgym.pipeline import PolicySession

    cfg = async_config(tiny_gpu_path, tmp_path, async_steps=2, iterations=5)
    session = PolicySession(cfg, "gpu-async-k2")
    try:
        staleness = play_k_ahead(session, 5, k=2)
        assert max(staleness) <= 2 and staleness[0] == 0, staleness
        versions = session.store.read_table("episodes").groupby("iteration")["policy_version"].max().to_dict()
        assert all(int(it) - int(v) <= 2 for it, v in versions.items()), versions
        assert session.policy_version == 5
    finally:
        session.close()


def test_two_rollouts_ahead_beside_a_deepspeed_update_on_one_gpu(tmp_path, tiny_gpu_path):
    """async_steps 2 with the hf engine (no vLLM needed): DeepSpeed updates on the GPU while the
    rollouts ahead play in a thread; the weights reach the engine only between rollouts and the
    staleness bound holds."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    import torch

    from agentgym.pipeline import PolicySession

    cfg = async_config(tiny_gpu_path, tmp_path, async_steps=2, iterations=5, engine="hf")
    session = PolicySession(cfg, "gpu-async-hf-k2")
    try:
        before = {k: v.float().cpu().clone() for k, v in session.trainer.named_weights()}
        staleness = play_k_ahead(session, 5, k=2)
        assert next(session.trainer.engine.module.parameters()).device.type == "cuda"
        assert session.engine.device.type == "cuda"  # rollout.device auto: the engine on the GPU too
        assert max(staleness) <= 2 and staleness[0] == 0, staleness
        versions = session.store.read_table("episodes").groupby("iteration")["policy_version"].max().to_dict()
        assert all(int(it) - int(v) <= 2 for it, v in versions.items()), versions
        after = dict(session.trainer.named_weights())
        assert any(not torch.equal(before[k], after[k].float().cpu()) for k in before), "no weight changed"
    finally:
        session.close()
