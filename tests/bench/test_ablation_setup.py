"""The ablation's runs differ only in the horizon schedule and the seed: same total iterations,
same episodes per iteration, same SFT settings; every (env, schedule) config validates."""

import sys
from pathlib import Path

import pytest

from agentgym.config import load_config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "learning"))
import ablation  # noqa: E402


@pytest.mark.parametrize("env", sorted(ablation.HORIZONS))
def test_schedules_share_everything_but_the_horizons(env):
    cfgs = {s: load_config(ROOT / "configs" / "ablation" / f"{env}.yaml", ablation.overrides(env, s, 1, 12))
            for s in ablation.SCHEDULES}
    assert {s: sum(x.iterations for x in c.stages) for s, c in cfgs.items()} == {s: 12 for s in cfgs}
    assert [x.horizon for x in cfgs["scaling"].stages] == sorted(x.horizon for x in cfgs["scaling"].stages)
    assert max(x.horizon for x in cfgs["short"].stages) < max(x.horizon for x in cfgs["long"].stages)
    dumps = [c.model_dump(exclude={"schedule"}) for c in cfgs.values()]
    assert all(d == dumps[0] for d in dumps) and dumps[0]["seed"] == 1 and dumps[0]["sft"]["enabled"]
    assert len({ablation.run_id(env, s, 1) for s in cfgs}) == 3
