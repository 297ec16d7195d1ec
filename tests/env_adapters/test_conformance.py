"""Every in-process adapter passes the conformance suite (tests/env_adapters/conformance.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
for _p in (str(_HERE.parents[1]), str(_HERE)):  # repo root (env_adapters) and this folder
    if _p not in sys.path:
        sys.path.insert(0, _p)

from conformance import check_env  # noqa: E402

from env_adapters import make_env  # noqa: E402

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
}


@pytest.mark.parametrize("env_name", sorted(CASES))
def test_conformance(env_name: str) -> None:
    from env_adapters import ADAPTERS

    module = ADAPTERS[env_name].split(":")[0]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not there yet")
    report = check_env(lambda: make_env(env_name), CASES[env_name], horizon=5)
    print(f"{env_name}: {report['steps']} steps, {report['ms_per_step']:.2f} ms/step "
          f"(incl. reset), {report['ms_per_reset']:.2f} ms/reset, "
          f"longest observation {report['max_obs_chars']} chars")
    assert report["steps"] > 0
