"""Every in-process adapter passes the conformance suite (env_adapters/checker.py).

Every adapter's package is a required dependency (pyproject.toml), so a missing one is a
failure here, never a skip.
"""

from __future__ import annotations

import importlib

import pytest

from env_adapters import ADAPTERS, make_env
from env_adapters.checker import check_env

CASES = {
    # BabyAI: GoToRedBallGrey, GoToObjS6 (-v1), Open, Pickup, and level 1 with minigrid seed 1
    "babyai": [0, 3, 11, 16, 40],
    # TextCraft: depth 1, 1, 2, 3, 4
    "textcraft": [0, 50, 300, 420, 540],
    "keyword": [0, 1, 2],
    "deepsearch": [0, 1, 2, 100, 490],  # train questions; 490 is the last
    # SciWorld: boil #0, power-component #0, find-living-thing #0 (AgentGym data_idx)
    "sciworld": [0, 1396, 2936],
    # TextWorldExpress (coin, default params): train seeds 0, 1, 2
    "textworld": [0, 1, 2],
    # MiniWoB++ in headless Chromium: click-test, click-collapsible, enter-text (instance 0)
    "miniwob": [0, 8, 13],
    # BFCL multi-turn: base_0, miss_param_50, miss_func_49 (a held-back function), long_context_38
    "bfcl": [0, 250, 449, 638],
    # MCP: mcp-server-git's packaged tasks make-branch, last-commit-message, count-commits
    "mcp": [0, 2, 5],
}

HORIZON = 5

# Adapters with their own move limit run the suite with a small one, so that the checker sees
# them truncate within the horizon: (constructor kwargs, the step at which they truncate).
# ScienceWorld ends a game once moves > envStepLimit (so step_limit=3 truncates the 4th step);
# the TextWorldExpress adapter truncates the step that reaches its step_limit.
MOVE_LIMITS: dict[str, tuple[dict, int]] = {
    "sciworld": ({"step_limit": 3}, 4),
    "textworld": ({"step_limit": 4}, 4),
}


def unavailable(env_name: str) -> str | None:
    """Why ``env_name`` cannot run on this machine (``None``: it can): MiniWoB++ needs Chromium
    and chromedriver, which come from apt (scripts/setup.sh), not from the virtualenv."""
    if env_name == "miniwob":
        from env_adapters.miniwob import chromium_missing

        return chromium_missing()
    return None


def env_kwargs(env_name: str) -> dict:
    return dict(MOVE_LIMITS[env_name][0]) if env_name in MOVE_LIMITS else {}


def truncate_at(env_name: str) -> int | None:
    return MOVE_LIMITS[env_name][1] if env_name in MOVE_LIMITS else None


def test_every_adapter_is_checked_and_importable() -> None:
    # "http" is the remote client: tests/env_adapters/test_conformance_http.py runs it; "agent"
    # is played by an agent program through the gateway (tests/agentgym/test_gateway.py)
    assert set(ADAPTERS) - {"http", "agent"} == set(CASES), "add the new adapter to CASES"
    for name, target in ADAPTERS.items():
        module, cls = target.split(":")
        assert hasattr(importlib.import_module(module), cls), f"{name}: {target} not found"


@pytest.mark.parametrize("env_name", sorted(CASES))
def test_conformance(env_name: str) -> None:
    if why := unavailable(env_name):
        pytest.skip(why)
    report = check_env(lambda: make_env(env_name, **env_kwargs(env_name)), CASES[env_name],
                       horizon=HORIZON, truncate_at=truncate_at(env_name))
    print(f"{env_name}: {report['steps']} steps, {report['ms_per_step']:.2f} ms/step "
          f"(incl. reset), {report['ms_per_reset']:.2f} ms/reset, "
          f"longest observation {report['max_obs_chars']} chars, "
          f"{report['truncated_runs']} runs truncated")
    assert report["steps"] > 0
    if env_name in MOVE_LIMITS:
        assert report["truncated_runs"] > 0


# Observation styles and action lists change what the policy reads or may choose, never the game:
# each runs the whole checker (the shipped configs' settings).
STYLES = [("babyai", {"observation_style": "compact"}), ("textcraft", {"observation_style": "inventory"}),
          ("textcraft", {"observation_style": "inventory", "action_list": "feasible"}),
          ("deepsearch", {"split": "all", "answer_candidates": "titles+numbers"})]


@pytest.mark.parametrize("env_name,kwargs", STYLES, ids=["-".join([n, *map(str, k.values())]) for n, k in STYLES])
def test_conformance_of_observation_styles(env_name: str, kwargs: dict) -> None:
    report = check_env(lambda: make_env(env_name, **kwargs), CASES[env_name], horizon=HORIZON)
    assert report["steps"] > 0
