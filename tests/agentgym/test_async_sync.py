"""PolicySession.sync_if_behind(before_step=...) under rollout.async_steps: a rollout played ahead
syncs at its start from another thread than the update. It keeps the engine's weights and starts
at once while an update is in progress, if the staleness bound still holds for it; it waits for
that update (and then syncs) when the bound needs it; it never copies weights mid-update."""

import threading
import time

import pytest

from agentgym.pipeline import IterationRef, PolicySession
from configs import keyword_env, parse_tiny_config  # tests/ is on sys.path


@pytest.fixture()
def session(tmp_path, model_cache):
    cfg = parse_tiny_config(model_cache, store_root=tmp_path / "store", seed=3, envs=[keyword_env()],
                            rollout={"tasks_per_iteration": 2, "async_steps": 2},
                            algorithm={"skip_tied_groups": False})
    s = PolicySession(cfg, "async-sync")
    yield s
    s.close()


def test_sync_before_a_rollout_ahead_waits_only_when_the_bound_needs_it(session):
    ref = IterationRef(0, 0, 0)
    session.collect(ref, horizon=1)
    session.advantages(ref)
    assert session.update(ref, sync=False)["updated"]
    assert (session.policy_version, session.engine_version) == (1, 0)

    session._weights_lock.acquire()  # an update is in progress
    try:
        # step 2's rollout with k = 2 needs the updates through step -1 (none): it plays on
        out = session.sync_if_behind(before_step=2)
        assert out["synced"] == 0.0 and session.engine_version == 0
        # step 3's needs step 0's update: it waits for the update in progress, then syncs
        t0 = time.perf_counter()
        threading.Timer(0.5, session._weights_lock.release).start()
        out = session.sync_if_behind(before_step=3)
        assert time.perf_counter() - t0 >= 0.5 and out["time/weight_sync_wait_s"] >= 0.3
        assert out["synced"] == 1.0 and session.engine_version == 1
    finally:
        if session._weights_lock.locked():
            session._weights_lock.release()
    # no update in progress: a rollout ahead takes the latest weights even when not required
    session.collect(IterationRef(0, 1, 1), horizon=1)
    session.advantages(IterationRef(0, 1, 1))
    session.update(IterationRef(0, 1, 1), sync=False)
    out = session.sync_if_behind(before_step=4)
    assert out["synced"] == 1.0 and out["time/weight_sync_wait_s"] < 0.3
    assert session.engine_version == session.policy_version == 2


def test_an_update_holds_the_weights_while_it_steps(session):
    """The update takes the weights lock around its optimizer steps, so a sync started during
    them waits: the weights it copies are those of a finished update."""
    ref = IterationRef(0, 0, 0)
    session.collect(ref, horizon=1)
    session.advantages(ref)
    trainer = session.trainer
    seen: list[bool] = []
    real = trainer.train_from_store

    def spy(*a, **kw):
        seen.append(session._weights_lock.locked())
        return real(*a, **kw)

    trainer.train_from_store = spy
    session.update(ref, sync=False)
    assert seen == [True] and not session._weights_lock.locked()
