"""PolicySession over one iteration with an unreachable environment server and a tied group:
infra-error episodes are stored unscored (reward NaN) and left out of metrics, advantages and
the update; the tied group is skipped and counted."""

import math
import socket

import numpy as np
import pandas as pd
import pytest

from agentgym.pipeline import InfraFailure, IterationRef, PolicySession
from configs import parse_tiny_config  # tests/ is on sys.path


def _dead_port() -> int:
    with socket.socket() as s:  # bound then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(tmp_path, model_cache, store=None, **rollout):
    return parse_tiny_config(model_cache, store_root=tmp_path / "store", seed=4, envs=[
        {"name": "keyword", "tasks": [0], "kwargs": {"target": "aeiou", "mode": "char_share"}},
        # an untrained model does not reply "xyzzy...": every reward is 0, a tied group
        {"name": "keyword", "tasks": [1], "kwargs": {"target": "xyzzy"}},
        {"name": "http", "tasks": [2], "kwargs": {
            "base_url": f"http://127.0.0.1:{_dead_port()}", "env_name": "babyai", "retries": 0}},
    ], rollout={"tasks_per_iteration": 3, **rollout}, store=store or {})


@pytest.fixture()
def session(tmp_path, model_cache):
    s = PolicySession(_config(tmp_path, model_cache), "session-test")
    yield s
    s.close()


def test_infra_errors_are_unscored_and_tied_groups_skipped(session):
    ref = IterationRef(0, 0, 0)
    rollout = session.collect(ref, horizon=1)
    episodes = pd.read_parquet(f"{session.cfg.store.root}/session-test/episodes")
    infra = episodes[episodes.infra_error]
    assert len(infra) == 2 and infra.env.eq("http").all() and infra.reward.isna().all()
    assert rollout["infra_error_episodes"] == 2
    # the metric is the mean over scored episodes, which is also what pandas gives
    assert rollout["reward_mean"] == pytest.approx(episodes.reward.mean())
    assert rollout["reward_mean"] == pytest.approx(episodes[~episodes.infra_error].reward.mean())

    adv = session.advantages(ref)
    table = session.store.read_table("advantages", stage=0, iteration=0)
    assert set(table.episode_id) == set(episodes[~episodes.infra_error].episode_id)
    assert math.isfinite(adv["adv_mean"]) and math.isfinite(adv["adv_std"]) and adv["tied_groups"] == 1

    tied = episodes[episodes.task_id == 1]
    assert (tied.reward == 0).all(), "the fixture's tied group is not tied"
    upd = session.update(ref)
    assert upd["updated"] and upd["skipped_episodes"] == 2 and upd["train_episodes"] == 2
    assert np.isfinite(upd["policy_loss"])


def test_too_many_infra_errors_fail_the_iteration_before_its_commit(tmp_path, model_cache):
    """2 of 6 episodes on a dead server: above a 0.2 limit the iteration fails, names the
    error, and commits nothing (a re-run rolls it out again instead of reusing it)."""
    s = PolicySession(_config(tmp_path, model_cache, max_infra_error_fraction=0.2), "strict")
    try:
        with pytest.raises(InfraFailure, match=r"2 of 6 episodes hit infrastructure errors.*http: infra"):
            s.collect(IterationRef(0, 0, 0), horizon=1)
        assert not s.store.is_committed("episodes", 0, 0)
    finally:
        s.close()


def test_a_streamed_rollout_that_fails_leaves_no_file_and_a_rerun_commits_once(tmp_path, model_cache):
    """The streaming path: 2 episodes play at a time and every 2 finished ones are written out
    (staged) during the rollout; the InfraFailure at the end deletes them all, and a re-run
    (a lenient setting here) commits the iteration once, in 3 chunks."""
    chunked = {"store": {"chunk_episodes": 2}, "max_live_episodes": 2}
    s = PolicySession(_config(tmp_path, model_cache, max_infra_error_fraction=0.2, **chunked), "stream")
    try:
        with pytest.raises(InfraFailure):
            s.collect(IterationRef(0, 0, 0), horizon=2)
    finally:
        s.close()
    run = tmp_path / "store" / "stream"
    assert not [p for p in run.rglob("*") if p.is_file()]  # no shard (staged or not), no commit
    s = PolicySession(_config(tmp_path, model_cache, max_infra_error_fraction=1.0, **chunked), "stream")
    try:
        out = s.collect(IterationRef(0, 0, 0), horizon=2)
        m = s.store.manifest("episodes", 0, 0)
        assert out["rows"] == m.rows == 6 and m.extra["chunks"] == 3 and out["infra_error_episodes"] == 2
        assert sorted(p.name for p in (run / "_commits").rglob("*.json")) == ["0-0.json", "0-0.json"]
        assert len(pd.read_parquet(s.store.path("episodes"))) == 6
        assert not list(run.rglob(".tmp-*"))
    finally:
        s.close()


def test_each_step_reports_where_its_time_went(session):
    """The ``time/*`` spans every step returns (MLflow metrics; bench/pipeline_overhead.py adds
    them up): each is a duration, and the parts of the rollout add up to its wall time."""
    ref = IterationRef(0, 0, 0)
    rollout = session.collect(ref, horizon=1)
    parts = ("time/generate_s", "time/rollout_store_write_s", "time/rollout_loop_env_s")
    assert all(rollout[k] >= 0 for k in parts + ("time/rollout_store_commit_s",)) and rollout["time/generate_s"] > 0
    assert sum(rollout[k] for k in parts) == pytest.approx(rollout["rollout_seconds"])
    assert rollout["time/generate_s"] == pytest.approx(session.engine.generate_seconds)
    adv = session.advantages(ref)
    assert all(adv[f"time/advantages_{k}_s"] >= 0 for k in ("store_read", "compute", "store_write"))
    upd = session.update(ref)
    spans = ("update_store_read", "train_batch_write", "trainer_start", "train", "train_store_read", "weight_sync")
    assert all(upd[f"time/{k}_s"] >= 0 for k in spans)
    assert upd["time/trainer_start_s"] > 0  # the first update builds the trainer
    assert upd["time/train_store_read_s"] < upd["time/train_s"]
    # from the train_batch write on: the write, the trainer's start, training, the weight sync
    inside = ("train_batch_write", "trainer_start", "train", "weight_sync")
    assert upd["update_seconds"] == pytest.approx(sum(upd[f"time/{k}_s"] for k in inside), abs=1e-3)
