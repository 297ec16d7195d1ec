"""Rollout workers as Ray actors on the shared two-node loopback cluster (conftest.py).

N workers play the episodes one worker plays; a worker SIGKILLed mid-rollout is re-created,
resynced and the iteration commits once; a lost node's workers are placed again when a node
joins; full fine-tuning syncs full weights to every worker through the object store.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pandas as pd
import pytest

from agentgym.cluster.rollout_pool import split_by_group
from agentgym.pipeline import IterationRef, PolicySession, plan_episodes
from agentgym.rollout.loop import EpisodeSpec
from configs import keyword_env, parse_tiny_config

pytestmark = pytest.mark.timeout(600)


def _config(model_cache, tmp_path, ray_address, workers: int, **over):
    """Multi-turn keyword episodes (a wrong word gets a retry prompt), 4 tasks x 2 samples,
    sampling seeded per (episode, turn); the rollout over ``workers`` actors of the shared
    cluster, one training rank."""
    env = over.pop("env", keyword_env(tasks=[0, 1, 2, 3], kwargs={"target": "yes", "mode": "starts_with"}))
    ray = {"address": ray_address, "cpus_per_worker": 1, "cpus_per_rank": 1, **over.pop("ray", {})}
    return parse_tiny_config(
        model_cache, store_root=tmp_path / "store", envs=[env], ray=ray,
        rollout={"workers": workers, "tasks_per_iteration": 4, "group_size": 2, "max_new_tokens": 4,
                 "sampling_seeds": "per_episode", "temperature": 1.0},
        schedule={"stages": [{"horizon": 3, "iterations": 2}]}, **over)


def _episodes(session: PolicySession, ref: IterationRef) -> pd.DataFrame:
    df = pd.DataFrame(session.store.read_table("episodes", stage=ref.stage, iteration=ref.iteration))
    return df.sort_values("episode_id").reset_index(drop=True)


def _tokens(df: pd.DataFrame) -> dict[str, list[int]]:
    return {e: list(map(int, ids)) for e, ids in zip(df["episode_id"], df["input_ids"])}


def test_split_by_group_keeps_groups_whole_and_balanced():
    specs = [EpisodeSpec("keyword", t, 0, f"g{t}", f"g{t}-e{i}") for t in range(5) for i in range(3)]
    shares = split_by_group(specs, 2)
    assert [len(s) for s in shares] == [9, 6]
    assert [s.episode_id for share in shares for s in share] == [s.episode_id for s in specs]
    for share in shares:  # no group on two workers
        assert all(all(x.group_id != y.group_id for y in shares[1 - shares.index(share)]) for x in share)
    assert [len(s) for s in split_by_group(specs[:3], 3)] == [3, 0, 0]


def test_two_workers_play_the_episodes_one_worker_plays(model_cache, tmp_path, ray_address):
    ref = IterationRef(0, 0, 0)
    got = {}
    for workers in (1, 2):
        cfg = _config(model_cache, tmp_path / f"w{workers}", ray_address, workers)
        session = PolicySession(cfg, "equiv")
        try:
            assert session.pool is not None and session.pool.size == workers
            if workers == 2:  # the shares really ran in two processes
                assert len(set(session.pool.pids)) == 2
            out = session.collect(ref, horizon=3)
            assert out["rows"] == 8 and out["rollout_workers"] == workers
            got[workers] = _episodes(session, ref)
        finally:
            session.close()
    one, two = got[1], got[2]
    assert list(one["episode_id"]) == list(two["episode_id"])
    assert _tokens(one) == _tokens(two)  # the same replies, token for token
    for a, b in zip(one["old_logprobs"], two["old_logprobs"]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    assert list(one["reward"]) == list(two["reward"]) and list(one["num_turns"]) == list(two["num_turns"])
    # seeded per episode: a group's two samples are not copies of each other
    assert len(set(map(tuple, _tokens(one).values()))) > len(one) // 2


def _hidden_files(session: PolicySession, ref: IterationRef) -> list[str]:
    root = os.path.join(session.store.spec()["root"], session.run_id, "episodes", f"stage={ref.stage}",
                        f"iteration={ref.iteration}")
    return [f for f in os.listdir(root) if f.startswith((".", "_"))] if os.path.isdir(root) else []


def test_a_killed_worker_is_recreated_resynced_and_the_iteration_commits_once(model_cache, tmp_path, ray_address):
    # 0.5 s per environment step: the rollout lasts long enough to kill a worker inside it
    env = keyword_env(tasks=[0, 1, 2, 3], kwargs={"target": "yes", "mode": "starts_with", "step_delay_s": 0.5})
    # all-zero rewards tie every group: train on them anyway, so the update bumps the version
    cfg = _config(model_cache, tmp_path, ray_address, 2, env=env, algorithm={"skip_tied_groups": False})
    session = PolicySession(cfg, "kill-worker")
    try:
        first = IterationRef(0, 0, 0)
        session.collect(first, horizon=3)
        session.advantages(first)
        assert session.update(first)["updated"]  # policy version 1, synced to both workers
        assert session.engine_version == 1
        victim = session.pool.pids[0]
        ref = IterationRef(0, 1, 1)
        box: dict = {}
        worker = threading.Thread(target=lambda: box.update(out=session.collect(ref, horizon=3)))
        worker.start()
        time.sleep(1.0)  # inside the first environment steps
        os.kill(victim, signal.SIGKILL)
        worker.join(timeout=300)
        out = box["out"]
        assert out["rollout_worker_restarts"] == 1.0 and victim not in session.pool.pids
        assert out["rows"] == 8
        df = _episodes(session, ref)
        want = sorted(s.episode_id for s in plan_episodes(cfg, 1))
        assert list(df["episode_id"]) == want  # every episode once: none lost, none twice
        assert set(df["policy_version"]) == {1}  # the re-created worker played on the synced weights
        manifest = session.store.manifest("episodes", ref.stage, ref.iteration)
        assert manifest is not None and manifest.rows == 8
        assert _hidden_files(session, ref) == []  # the dead worker's staged shards are gone
        assert session.collect(ref, horizon=3)["reused"]  # committed once: a re-run reuses it
    finally:
        session.close()


def test_a_lost_nodes_workers_are_placed_again_when_a_node_joins(model_cache, tmp_path, ray_cluster):
    spare = {"agentgym_spare": 2}
    node = ray_cluster.add_node(num_cpus=2, resources=spare, node_ip_address="127.0.0.1")
    ray_cluster.wait_for_nodes()
    cfg = _config(model_cache, tmp_path, ray_cluster.address, 2,
                  ray={"worker_resources": {"agentgym_spare": 1}, "placement_timeout_s": 120})
    session = PolicySession(cfg, "kill-node")
    joined = None
    try:
        session.collect(IterationRef(0, 0, 0), horizon=3)
        ray_cluster.remove_node(node)  # every process of that node: both workers
        ref = IterationRef(0, 1, 1)
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(out=session.collect(ref, horizon=3)))
        t.start()
        time.sleep(3.0)
        joined = ray_cluster.add_node(num_cpus=2, resources=spare, node_ip_address="127.0.0.1")
        t.join(timeout=300)
        out = box["out"]
        assert out["rows"] == 8 and out["rollout_worker_restarts"] == 2.0
        assert sorted(_episodes(session, ref)["episode_id"]) == sorted(s.episode_id for s in plan_episodes(cfg, 1))
    finally:
        session.close()
        if joined is not None:
            ray_cluster.remove_node(joined)


@pytest.mark.parametrize("channel", ["object_store", "broadcast"])
def test_full_fine_tuning_syncs_full_weights_to_two_workers(model_cache, tmp_path, ray_address, channel):
    # the dense char_share reward: groups carry a signal, so the weights move
    cfg = _config(model_cache, tmp_path, ray_address, 2, env=keyword_env(tasks=[0, 1, 2, 3]),
                  trainer={"world_size": 2, "micro_batch_size": 2}, ray={"weight_sync": channel})
    session = PolicySession(cfg, "full-ft")
    try:
        import ray

        before = ray.get([w.digest.remote() for w in session.pool._workers])
        ref = IterationRef(0, 0, 0)
        session.collect(ref, horizon=3)
        session.advantages(ref)
        out = session.update(ref)
        assert out["updated"] and out["policy_version"] == 1
        trained = session.trainer.weight_digests()
        assert len(set(trained.values())) == 1  # both ranks hold the same weights
        held = ray.get([w.digest.remote() for w in session.pool._workers])
        assert held == [trained[0]] * 2  # every worker serves exactly the trained weights
        assert held != before  # and they are not the base model's
    finally:
        session.close()


def test_the_broadcast_group_reforms_after_a_worker_is_recreated(model_cache, tmp_path, ray_address):
    """weight_sync: broadcast (gloo here, NCCL on GPUs): a worker killed between two updates is
    re-created with the current weights through the object store, and the next sync re-forms
    the group with it; every worker ends on the trained weights."""
    import ray

    cfg = _config(model_cache, tmp_path, ray_address, 2, env=keyword_env(tasks=[0, 1, 2, 3]),
                  ray={"weight_sync": "broadcast"})
    session = PolicySession(cfg, "broadcast-kill")
    try:
        for it in range(2):
            ref = IterationRef(0, it, it)
            if it == 1:
                os.kill(session.pool.pids[1], signal.SIGKILL)
            out = session.collect(ref, horizon=3)
            assert out["rows"] == 8
            session.advantages(ref)
            assert session.update(ref)["updated"]
        assert session.pool.restarts == 1
        trained = session.trainer.weight_digests()[0]
        assert ray.get([w.digest.remote() for w in session.pool.workers]) == [trained] * 2
        episodes = pd.DataFrame(session.store.read_table("episodes", stage=0, iteration=1))
        assert set(episodes["policy_version"]) == {1}
    finally:
        session.close()


def test_a_worker_dying_too_often_fails_the_rollout_and_commits_nothing(model_cache, tmp_path, ray_address):
    from agentgym.cluster.rollout_pool import RolloutWorkerError

    env = keyword_env(tasks=[0, 1, 2, 3], kwargs={"target": "yes", "mode": "starts_with", "step_delay_s": 0.5})
    cfg = _config(model_cache, tmp_path, ray_address, 2, env=env, ray={"max_actor_restarts": 0})
    session = PolicySession(cfg, "too-often")
    try:
        ref = IterationRef(0, 0, 0)
        victim = session.pool.pids[1]
        threading.Timer(1.0, os.kill, (victim, signal.SIGKILL)).start()
        with pytest.raises(RolloutWorkerError, match="ray.max_actor_restarts=0"):
            session.collect(ref, horizon=3)
        assert session.store.manifest("episodes", ref.stage, ref.iteration) is None
        assert session.store.read_table("episodes", stage=0, iteration=0).empty
        # the retry (same call, same session): the dead worker was already re-created
        out = session.collect(ref, horizon=3)
        assert out["rows"] == 8 and sorted(_episodes(session, ref)["episode_id"]) == \
            sorted(s.episode_id for s in plan_episodes(cfg, 0))
    finally:
        session.close()
