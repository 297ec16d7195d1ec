"""Dynamic sampling (rollout.max_draws): tied groups make the iteration draw more tasks, up to the
bound; informative draws stop it; every drawn episode is committed with unique ids."""

import pandas as pd
import pytest

from agentgym.pipeline import IterationRef, PolicySession, plan_episodes
from configs import DEFAULT, parse_tiny_config  # tests/ is on sys.path


def _config(tmp_path, model_cache, envs: list[dict], max_draws: int):
    # collection only: the library's trainer settings
    return parse_tiny_config(model_cache, store_root=tmp_path / "store", seed=1, envs=envs,
                             rollout={"max_new_tokens": 4, "max_draws": max_draws}, trainer=DEFAULT)


def _keyword(tmp_path, model_cache, target: str, mode: str = "starts_with", max_draws: int = 3):
    env = {"name": "keyword", "tasks": [0, 1, 2, 3, 4, 5], "kwargs": {"target": target, "mode": mode}}
    return _config(tmp_path, model_cache, [env], max_draws)


def test_draws_are_distinct_and_draw_zero_is_unchanged(tmp_path, model_cache):
    cfg = _keyword(tmp_path, model_cache, "x")
    first, again = plan_episodes(cfg, 5), plan_episodes(cfg, 5, draw=0)
    assert [s.episode_id for s in first] == [s.episode_id for s in again]
    assert not any("-d" in s.group_id for s in first)
    second = plan_episodes(cfg, 5, draw=1)
    assert all(s.group_id.endswith("-d1") for s in second)
    assert not {s.episode_id for s in first} & {s.episode_id for s in second}
    assert len({s.group_id for s in plan_episodes(cfg, 5, draw=2, tasks=1)}) == 1


def test_a_further_draw_replaces_only_the_tied_groups(tmp_path, model_cache):
    """One environment always ties (an untrained model never says "xyzzyq"), the other never
    does (char_share): after the first draw one of the two groups is informative, so the second
    draw plays one task, not two."""
    cfg = _config(tmp_path, model_cache, [
        {"name": "keyword", "tasks": [0, 1, 2], "kwargs": {"target": "xyzzyq", "mode": "starts_with"}},
        {"name": "keyword", "tasks": [3, 4, 5], "kwargs": {"target": "aeiou", "mode": "char_share"}}], max_draws=2)
    session = PolicySession(cfg, "ds-partial")
    try:
        out = session.collect(IterationRef(0, 0, 0), horizon=1)
    finally:
        session.close()
    episodes = pd.read_parquet(tmp_path / "store" / "ds-partial" / "episodes")
    assert out["sampling_draws"] == 2
    assert episodes.group_id.nunique() == 3 and len(episodes) == 3 * 2


@pytest.mark.parametrize("target,mode,draws", [("xyzzyq", "starts_with", 3), ("aeiou", "char_share", 1)])
def test_tied_groups_draw_again_up_to_the_bound(tmp_path, model_cache, target, mode, draws):
    # an untrained model never says "xyzzyq": every group ties at 0 and all 3 draws are made;
    # char_share rewards differ between samples: the first draw is informative
    session = PolicySession(_keyword(tmp_path, model_cache, target, mode), "ds-test")
    try:
        out = session.collect(IterationRef(0, 0, 0), horizon=1)
    finally:
        session.close()
    assert out["sampling_draws"] == draws
    episodes = pd.read_parquet(tmp_path / "store" / "ds-test" / "episodes")
    # every group tied: each further draw replaces both groups
    assert len(episodes) == draws * 2 * 2 and episodes.episode_id.is_unique
    assert episodes.group_id.nunique() == draws * 2
    if draws == 3:
        assert out["informative_groups"] == 0
    else:
        assert out["informative_groups"] >= 2
