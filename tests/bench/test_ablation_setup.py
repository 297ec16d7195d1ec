"""The ablation's runs differ only in the horizon schedule and the seed: same total iterations,
same episodes per iteration, same warm start; every (env, schedule) config validates."""

import sys
from pathlib import Path

import pytest

from agentgym.config import load_config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "learning"))
import ablation  # noqa: E402


@pytest.mark.parametrize("env", sorted(ablation.HORIZONS))
def test_schedules_share_everything_but_the_horizons(env, tmp_path):
    warm = str(tmp_path / "sft")
    cfgs = {s: load_config(ablation.config_path(env), ablation.overrides(env, s, 1, ablation.ITERATIONS, warm))
            for s in ablation.SCHEDULES}
    assert {s: sum(x.iterations for x in c.stages) for s, c in cfgs.items()} == {s: ablation.ITERATIONS for s in cfgs}
    assert [x.horizon for x in cfgs["scaling"].stages] == sorted(x.horizon for x in cfgs["scaling"].stages)
    assert max(x.horizon for x in cfgs["short"].stages) < max(x.horizon for x in cfgs["long"].stages)
    dumps = [c.model_dump(exclude={"schedule"}) for c in cfgs.values()]
    assert all(d == dumps[0] for d in dumps) and dumps[0]["seed"] == 1
    assert dumps[0]["model"]["name_or_path"] == warm and not dumps[0]["sft"]["enabled"]
    # from the base model each run measures its own base row; from a warm start the warm start did
    assert dumps[0]["heldout"]["base"] == (env in ablation.FROM_BASE)
    assert dumps[0]["heldout"]["horizon"] == ablation.HORIZONS[env][2]
    assert len({ablation.run_id(env, s, 1) for s in cfgs}) == 3


@pytest.mark.parametrize("env", sorted(set(ablation.HORIZONS) - set(ablation.FROM_BASE)))
def test_the_warm_start_trains_sft_and_measures_the_rows_before_rl(env):
    cfg = load_config(ablation.config_path(env), ablation.warmstart_overrides(env))
    assert cfg.sft.enabled and cfg.heldout.enabled and cfg.heldout.base
    assert cfg.heldout.horizon == ablation.HORIZONS[env][2]
    assert sum(s.iterations for s in cfg.stages) == 1


def test_a_run_without_its_warm_start_says_what_to_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ablation, "TRACKING", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setattr(ablation, "ROOT", Path("/"))
    args = type("A", (), {"env": "babyai", "schedule": "short", "seed": 0, "iterations": None, "set": None})
    assert ablation.cmd_run(args) == 2
    assert "ablation.py warmstart --env babyai" in capsys.readouterr().err


def test_the_report_pairs_the_schedules_on_the_tasks_all_of_them_evaluated():
    tasks = range(40)
    scaling = [{t: float(t < 30) for t in tasks}, {t: float(t < 28) for t in tasks}]
    short = [{t: float(t < 10) for t in tasks} | {99: 1.0}]  # task 99: only one arm has it, left out
    rows = ablation._interval_rows({"scaling": scaling, "short": short, "long": []})
    text = "\n".join(rows)
    assert "the 40 held-out tasks" in text
    assert "| scaling (2 seeds) | 0.725 |" in text and "| short (1 seeds) | 0.250 |" in text
    diff_row = next(r for r in rows if r.startswith("| scaling − short"))
    diff, interval = diff_row.split("|")[2:4]
    lo, hi = (float(x) for x in interval.strip(" []").split(","))
    assert float(diff) == pytest.approx(0.475) and 0 < lo < 0.475 < hi
    assert not any("long" in r for r in rows)


@pytest.mark.parametrize("variant", sorted(ablation.VARIANTS))
def test_a_variant_changes_only_its_section(variant, tmp_path):
    base = ablation.overrides("babyai-base", "scaling", 0, 51, "smollm2")
    plain = load_config(ablation.config_path("babyai-base"), base)
    varied = load_config(ablation.config_path("babyai-base"), base + ablation.VARIANTS[variant])
    if variant == "async":
        assert varied.rollout.async_steps == 1 and plain.rollout.async_steps == 0
    else:
        assert varied.algorithm.credit == "turn"
        assert varied.algorithm.turn_baseline == {"gigpo": "state"}.get(variant, "turn")
    section = ablation.VARIANT_SECTION[variant]
    a, b = plain.model_dump(), varied.model_dump()
    assert a[section] != b[section]
    a.pop(section), b.pop(section)
    assert a == b
    rid = ablation.run_id("babyai-base", "scaling", 0, variant)
    assert rid not in {ablation.run_id("babyai-base", s, 0) for s in ablation.SCHEDULES}
    rows = ablation._interval_rows({"scaling": [{0: 1.0, 1: 0.0}], ablation.arm("scaling", variant): [{0: 1.0, 1: 1.0}]})
    assert any(r.startswith(f"| scaling + {variant} − scaling | +0.500") for r in rows)
