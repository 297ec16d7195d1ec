"""PolicySession.retract_lost_work: after a checkpoint older than the last committed iteration is
restored (a stage resumed with tracking.checkpoint_every 0), what updates past that checkpoint
produced is withdrawn from the store and done again, never trained on."""

import contextlib

from agentgym.pipeline import IterationRef, PolicySession
from configs import keyword_env, parse_tiny_config  # tests/ is on sys.path


def _config(model_cache, tmp_path, async_steps=0):
    return parse_tiny_config(model_cache, store_root=tmp_path / "store", seed=3, envs=[keyword_env()],
                             rollout={"tasks_per_iteration": 2, "async_steps": async_steps},
                             algorithm={"skip_tied_groups": False},
                             schedule={"stages": [{"horizon": 1, "iterations": 4}]})


def _iterate(session, it, *, collect=True):
    ref = IterationRef(0, it, it)
    if collect:
        session.collect(ref, horizon=1)
    session.advantages(ref)
    assert session.update(ref, sync=True)["updated"]


@contextlib.contextmanager
def _restored(cfg, run_id, version):
    """A new session on the run, as restore_policy leaves it: at the checkpoint's policy version."""
    session = PolicySession(cfg, run_id)
    session.policy_version = session.engine_version = version
    try:
        yield session
    finally:
        session.close()


def _committed(store, table):
    return [c.iteration for c in store.commits(table)]


def _versions(store):
    df = store.read_table("episodes", columns=["iteration", "policy_version"])
    return {int(k): int(v) for k, v in df.groupby("iteration", observed=True)["policy_version"].max().items()}


def test_iterations_sampled_after_the_checkpoint_are_retracted_and_rolled_again(model_cache, tmp_path):
    cfg = _config(model_cache, tmp_path)
    first = PolicySession(cfg, "retract")
    try:
        for it in range(3):  # versions 0, 1, 2 sample iterations 0, 1, 2; killed after update 2
            _iterate(first, it)
        assert _versions(first.store) == {0: 0, 1: 1, 2: 2}
    finally:
        first.close()

    # resumed from the checkpoint after iteration 0 (step 1, policy version 1)
    with _restored(cfg, "retract", 1) as resumed:
        assert resumed.retract_lost_work(1) == [2]
        store = resumed.store
        assert _versions(store) == {0: 0, 1: 1}  # iteration 1 was sampled by the checkpoint's policy
        assert _committed(store, "advantages") == _committed(store, "train_batch") == [0, 1]
        _iterate(resumed, 1, collect=False)  # reused: its rollout is the checkpoint's own
        _iterate(resumed, 2)                 # rolled out again, by the resumed run's policy
        assert _versions(store) == {0: 0, 1: 1, 2: 2}
        assert resumed.retract_lost_work(3) == []  # nothing past the newest state


def test_a_rollout_ahead_sampled_by_the_checkpoint_stays_but_its_advantages_go(model_cache, tmp_path):
    """async_steps 1, killed after update 1 and iteration 2's advantages, with the last
    checkpoint at step 1 (after update 0): iteration 2 was played ahead by that checkpoint's
    policy, so its episodes stay; its advantages were computed after update 1, which is lost."""
    cfg = _config(model_cache, tmp_path, async_steps=1)
    first = PolicySession(cfg, "retract-async")
    try:
        ref = [IterationRef(0, it, it) for it in range(3)]
        first.collect(ref[0], horizon=1)
        first.collect(ref[1], horizon=1)      # ahead of update 0: version 0
        first.advantages(ref[0])
        first.update(ref[0], sync=False)
        first.sync_if_behind(before_step=2)
        first.collect(ref[2], horizon=1)      # ahead of update 1: version 1
        first.advantages(ref[1])
        first.update(ref[1], sync=False)
        first.advantages(ref[2])              # after update 1: killed here
        assert _versions(first.store) == {0: 0, 1: 0, 2: 1}
    finally:
        first.close()

    with _restored(cfg, "retract-async", 1) as resumed:
        assert resumed.retract_lost_work(1) == [2]
        assert _versions(resumed.store) == {0: 0, 1: 0, 2: 1}  # every rollout stays
        assert _committed(resumed.store, "advantages") == _committed(resumed.store, "train_batch") == [0, 1]
        _iterate(resumed, 1, collect=False)
        _iterate(resumed, 2, collect=False)   # staleness 1: within the bound
        assert _committed(resumed.store, "advantages") == [0, 1, 2]


def test_without_a_checkpoint_everything_past_the_first_policy_goes(model_cache, tmp_path):
    """Killed in the first stage before any checkpoint: the run restarts at step 0 with the
    initial weights (version 0), so only rollouts that version sampled stay."""
    cfg = _config(model_cache, tmp_path)
    first = PolicySession(cfg, "retract-none")
    try:
        for it in range(2):
            _iterate(first, it)
    finally:
        first.close()
    with _restored(cfg, "retract-none", 0) as resumed:
        assert resumed.retract_lost_work(0) == [1]
        assert _versions(resumed.store) == {0: 0}
        assert _committed(resumed.store, "advantages") == [0]
