"""Table 1's harness (bench/learning/table1.py), its pure parts: cell ids, the RL cells' configs,
the environment-step budget of the fixed long horizon, and the report from records."""

import sys
from pathlib import Path

import numpy as np
import pytest

from agentgym.config import load_config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "learning"))
import table1  # noqa: E402
from bootstrap import mean_interval, paired_difference  # noqa: E402


def test_cell_ids_name_env_row_and_seed_and_refuse_what_is_not_a_cell():
    ids = {table1.cell_id(e, r) for e in table1.COLUMNS for r in ("random", "base")}
    ids |= {table1.cell_id(e, r, s) for e in table1.COLUMNS for r in table1.RL_ROWS for s in (0, 1, 2)}
    assert len(ids) == len(table1.COLUMNS) * (2 + 2 * 3)  # every cell its own id (and record, and run)
    assert table1.cell_id("sciworld", "long", 2) == "table1-sciworld-long-s2"
    assert table1.record_path("table1-babyai-base").parent == table1.RECORDS
    for bad in (("webarena", "base", None), ("babyai", "sft", None), ("babyai", "scaling", None),
                ("babyai", "random", 0)):
        with pytest.raises(ValueError):
            table1.cell_id(*bad)


def test_the_long_run_is_ended_by_the_scaling_runs_env_steps():
    # the cap never binds first: 32 episodes an iteration play at least 32 steps
    assert table1.long_cap(3342, 32) == 105 and table1.long_cap(5, 32) == 1
    for bad in ((0, 32), (100, 0)):
        with pytest.raises(ValueError):
            table1.long_cap(*bad)
    sets = table1.rl_overrides("textcraft", "long", 1, 105, 3342)
    assert "schedule.max_env_steps=3342" in sets
    assert not any(s.startswith("schedule.max_env_steps") for s in table1.rl_overrides("textcraft", "scaling", 1))
    from agentgym.config import load_config

    assert load_config(table1.config_path("textcraft"), sets).schedule.max_env_steps == 3342
    # the long runs' ids differ from the runs made before the budget (a resume would refuse them)
    assert table1.run_id("textcraft", "long", 1) == "table1-textcraft-long-s1-budget"
    assert table1.run_id("textcraft", "scaling", 1) == "table1-textcraft-scaling-s1"
    # a revised config's runs are new runs, never a resume of the old config's
    assert table1.run_id("babyai", "scaling", 0) == "table1-babyai-scaling-s0-m6"
    assert table1.run_id("babyai", "long", 2) == "table1-babyai-long-s2-budget-m6"


@pytest.mark.parametrize("env", sorted(table1.COLUMNS))
def test_the_rl_cells_are_the_shipped_config_with_only_the_schedule_and_tracking_changed(env):
    shipped = load_config(table1.config_path(env))
    scaling = load_config(table1.config_path(env), table1.rl_overrides(env, "scaling", 1))
    long = load_config(table1.config_path(env), table1.rl_overrides(env, "long", 1, 7))
    horizon = table1.heldout_horizon(env)
    # scaling: the config's own horizons; long: one stage at the held-out horizon
    assert [s.horizon for s in scaling.stages] == [s.horizon for s in shipped.stages]
    assert {s.iterations for s in scaling.stages} == {table1.ITERATIONS_PER_STAGE[env]}
    assert [(s.horizon, s.iterations) for s in long.stages] == [(horizon, 7)]
    # the scaling run keeps the config's task curriculum; the fixed long horizon has none
    assert [s.tasks for s in scaling.stages] == [s.tasks for s in shipped.stages]
    assert long.stages[0].tasks is None
    assert horizon == max(s.horizon for s in shipped.stages) or horizon == shipped.heldout.horizon
    for cfg in (scaling, long):
        assert cfg.seed == 1 and cfg.heldout.enabled and not cfg.heldout.base and not cfg.sft.enabled
        assert cfg.heldout.horizon == horizon and cfg.tracking.tracking_uri == table1.TRACKING
        # what the policy plays and learns with is the shipped config's
        for part in ("model", "envs", "rollout", "algorithm", "trainer", "system_prompt"):
            assert getattr(cfg, part) == getattr(shipped, part), part
    with pytest.raises(ValueError):
        table1.stages(env, "long")  # its iterations come from the scaling run


def _record(env, row, per_env, **extra):
    return {"cell": "x", "env": env, "row": row, "horizon": 10, "per_env": per_env, **extra}


def _synthetic():
    tasks = list(range(32))
    succ = lambda k: [float(t < k) for t in tasks]  # noqa: E731
    recs = [
        _record("babyai", "random", {"babyai": {"tasks": tasks, "success": [succ(8), succ(10)],
                                                "reward": [succ(8), succ(10)]}}),
        _record("babyai", "base", {"babyai": {"tasks": tasks, "success": [succ(4)], "reward": [succ(4)]}}),
        _record("babyai", "scaling", {"babyai": {"tasks": tasks, "success": [succ(20)], "reward": [succ(20)]}}, seed=0),
        _record("babyai", "scaling", {"babyai": {"tasks": tasks, "success": [succ(24)], "reward": [succ(24)]}}, seed=1),
        _record("babyai", "long", {"babyai": {"tasks": tasks, "success": [succ(16)], "reward": [succ(16)]}}, seed=0,
                budget_env_steps=1000.0, env_steps=1100.0, stages=[{"horizon": 10, "iterations": 9}],
                steps_per_iteration=[1100.0 / 9] * 9),
        _record("babyai", "long", {"babyai": {"tasks": tasks, "success": [succ(18)], "reward": [succ(18)]}}, seed=1,
                budget_env_steps=1000.0, max_env_steps=1000, env_steps=1040.0, stages=[{"horizon": 10, "iterations": 40}],
                steps_per_iteration=[130.0] * 8),
        _record("sciworld", "base", {"sciworld": {"tasks": tasks, "success": [succ(0)],
                                                  "reward": [[0.25] * 32]}}),
        _record("mixed", "random", {"babyai": {"tasks": tasks, "success": [succ(16)], "reward": [succ(16)]},
                                    "textcraft": {"tasks": tasks, "success": [succ(8)], "reward": [succ(8)]}}),
        # a config's column is named after the config, its records after the adapter
        _record("textworld_express", "random", {"textworld": {"tasks": tasks, "success": [succ(12)],
                                                              "reward": [succ(12)]}}),
    ]
    return recs


def test_a_cell_is_the_mean_over_seeds_and_tasks_with_the_bootstrap_interval():
    recs = _synthetic()
    s = table1.cell_stats(recs, "babyai", "random", "babyai")
    x = np.array([[float(t < 8) for t in range(32)], [float(t < 10) for t in range(32)]])
    assert (s["mean"], s["lo"], s["hi"]) == pytest.approx(mean_interval(x)) and s["mean"] == pytest.approx(9 / 32)
    assert s["tasks"] == 32 and s["seeds"] == 2
    # the RL rows: one seed row per run, in seed order
    s = table1.cell_stats(recs, "babyai", "scaling", "babyai")
    assert s["seeds"] == 2 and s["mean"] == pytest.approx(22 / 32) and s["lo"] < s["mean"] < s["hi"]
    assert table1.cell_stats(recs, "textcraft", "base", "textcraft") is None
    # SciWorld's score: the reward (running score / 100) x 100
    assert table1.cell_stats(recs, "sciworld", "base", "sciworld", "reward", 100.0)["mean"] == pytest.approx(25.0)


def test_the_report_lays_out_rows_columns_intervals_budget_and_the_papers_numbers():
    text = table1.report_markdown(_synthetic(), commands={})
    lines = text.splitlines()
    header = lines[0]
    assert "babyai (babyai.yaml)" in header and "mixed/babyai" in header and "mixed/textcraft" in header
    assert "textworld_express (textworld_express.yaml)" in header
    row = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]] for ln in lines if ln.startswith("| ")}
    cols = [c.strip() for c in header.split("|")[2:-1]]
    babyai = cols.index("babyai (babyai.yaml)")
    assert row["random valid action (10 seeds)"][babyai].startswith("0.281 [")
    assert row["after ScalingInter-RL (from base)"][babyai].endswith("(2 seeds)")
    assert row["after ScalingInter-RL (from base)"][cols.index("textcraft (textcraft.yaml)")] == "to run"
    # a column shown to have no reward to learn from names its probe instead
    assert row["after ScalingInter-RL (from base)"][cols.index("sciworld (sciworld.yaml)")] \
        == f"no signal ({table1.NO_SIGNAL['sciworld'][0]}; {table1.NO_SIGNAL['sciworld'][1]})"
    assert row["base SmolLM2-135M-Instruct"][cols.index("textcraft (textcraft.yaml)")] == "—"
    # a one-stage config's scaling run is a fixed horizon already
    assert row["after fixed long horizon, same env steps"][cols.index("miniwob (miniwob.yaml)")] \
        == "= scaling (one stage)"
    assert row["random valid action (10 seeds)"][cols.index("mixed/textcraft")].startswith("0.250 [")
    assert row["held-out tasks"][babyai] == "32"
    # the curriculum against the fixed long horizon, paired on tasks: (20 + 24) / 2 - (16 + 18) / 2
    # of 32 tasks; only where both rows exist
    d = table1.paired_stats(_synthetic(), "babyai", "babyai")
    assert d["mean"] == pytest.approx(5 / 32) and d["lo"] <= d["mean"] <= d["hi"] and d["seeds"] == (2, 2)
    x = lambda k: [float(t < k) for t in range(32)]  # noqa: E731
    assert (d["mean"], d["lo"], d["hi"]) == pytest.approx(paired_difference(np.array([x(20), x(24)]),
                                                                            np.array([x(16), x(18)])))
    assert row[table1.PAIRED_TITLE][babyai] == f"{d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] (2 seeds)"
    assert row[table1.PAIRED_TITLE][cols.index("textcraft (textcraft.yaml)")] == "—"
    assert row["random valid action (10 seeds)"][cols.index("textworld_express (textworld_express.yaml)")] \
        .startswith("0.375 [")
    assert "sciworld score (0-100, mean final running score x 100): base SmolLM2-135M-Instruct: 25.0 [25.0, 25.0]" in text
    assert "| babyai | 0 | 1000 | 1100 | 1.10 | 9 | estimated iterations (before the budget) |" in text
    assert "| babyai | 1 | 1000 | 1040 | 1.04 | 8 | schedule.max_env_steps |" in text
    assert "96.67" in text and "66.67" in text and "135M" in text and "7B" in text and "WebArena" in text


def test_report_update_rewrites_only_the_marked_table_and_refuses_a_missing_marker():
    table = table1.report_markdown(_synthetic(), commands={}, paper=False)
    assert "| policy |" in table and "96.67" not in table  # the doc keeps its own paper table
    doc = f"# Results\n\nprose before\n{table1.REPORT_BEGIN}\n| old | table |\n{table1.REPORT_END}\nprose after\n"
    new = table1.splice_report(doc, table)
    assert new.startswith("# Results\n\nprose before\n") and new.endswith(f"{table1.REPORT_END}\nprose after\n")
    assert "| old | table |" not in new and table in new
    assert table1.splice_report(new, table) == new  # idempotent
    for broken in (doc.replace(table1.REPORT_END, ""), doc + table1.REPORT_BEGIN):
        with pytest.raises(ValueError, match="exactly once"):
            table1.splice_report(broken, table)


def test_per_task_results_come_from_the_pipelines_heldout_report():
    report = {"tasks": [
        {"env": "sciworld", "task_id": 29, "category": "boil", "n": 1, "successes": 0, "reward_mean": 0.35},
        {"env": "sciworld", "task_id": 28, "category": "boil", "n": 1, "successes": 1, "reward_mean": 1.0},
        {"env": "babyai", "task_id": 40, "category": "goto", "n": 0, "successes": 0, "reward_mean": float("nan")}]}
    got = table1.per_env_from_report(report)
    assert got["sciworld"] == {"tasks": [29, 28], "success": [[0.0, 1.0]], "reward": [[0.35, 1.0]]}
    assert np.isnan(got["babyai"]["success"][0][0])  # an infra fault is not a failure


@pytest.mark.parametrize("env", sorted(table1.NO_SIGNAL))
def test_a_no_signal_column_is_backed_by_its_committed_probe(env):
    """The probe a "no signal" cell names exists, is of that environment, and earned no reward
    and no update in any iteration."""
    import json
    import re

    reason, probe = table1.NO_SIGNAL[env]
    for name in [probe, *re.findall(r"probes/[\w.-]+\.json", reason)]:
        rec = json.loads((table1.RECORDS / name).read_text())
        it = rec["results"]["per_iteration"]
        assert rec["config"]["env"] == env and rec["results"]["rc"] == 0 and it["episodes"], name
        assert max(it["reward_mean"]) == 0.0 and max(it["success_rate"]) == 0.0 and not it["update_seconds"], name


def test_random_train_scores_a_stages_task_subset_and_writes_its_record(tmp_path, monkeypatch):
    import argparse
    import json

    monkeypatch.setattr(table1, "RECORDS", tmp_path)
    (tmp_path / "probes").mkdir()
    args = argparse.Namespace(env="textcraft", stage=0, all_tasks=False, seeds=2, set=None)
    assert table1.cmd_random_train(args) == 0
    rec = json.loads((tmp_path / "probes" / "textcraft-stage0-random.json").read_text())["results"]
    got = rec["per_env"]["textcraft"]
    assert got["tasks"] == load_config(table1.config_path("textcraft")).stages[0].tasks["textcraft"]
    assert rec["horizon"] == 6 and all(0 <= w <= 2 for w in got["seeds_won"])
    assert got["success"] == sum(got["seeds_won"]) / (2 * len(got["tasks"])) > 0


def test_the_curve_figure_draws_the_rl_cells_that_have_a_training_curve(tmp_path):
    recs = _synthetic()
    assert table1.curve_figure(recs, "babyai", tmp_path / "none.png") is None  # no training curve yet
    assert not (tmp_path / "none.png").exists()
    for r in recs:
        if r["row"] in table1.RL_ROWS:
            n = sum(s["iterations"] for s in r.setdefault("stages", [{"horizon": 5, "iterations": 2},
                                                                      {"horizon": 10, "iterations": 2}]))
            r["steps_per_iteration"], r["train_success"] = [100.0] * n, [i / n for i in range(n)]
    out = table1.curve_figure(recs, "babyai", tmp_path / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert table1.curve_figure(recs, "textcraft", tmp_path / "tc.png") is None


def test_every_committed_rl_record_has_its_training_curve():
    """One value per iteration, as many as its environment steps (run records it since the
    curves; older records got it from their MLflow runs: ``table1.py curves``)."""
    runs = [r for r in table1.load_records() if r["row"] in table1.RL_ROWS]
    assert runs
    for r in runs:
        assert len(r["train_success"]) == len(r["steps_per_iteration"]), r["cell"]
        assert all(0.0 <= x <= 1.0 for x in r["train_success"]), r["cell"]
        if r.get("max_env_steps"):  # ended by the budget: the last iteration crossed it
            assert sum(r["steps_per_iteration"][:-1]) < r["max_env_steps"] <= sum(r["steps_per_iteration"]), r["cell"]
        else:
            assert len(r["steps_per_iteration"]) == sum(s["iterations"] for s in r["stages"]), r["cell"]


def test_precision_follows_the_records_cpu_flags_and_the_report_names_the_minority():
    assert table1.precision({"cpu_flags": ["avx2", "avx512f", "avx512_bf16", "fma"]}) == "bf16"
    assert table1.precision({"cpu_flags": ["avx2", "fma"]}) == "fp32"
    assert table1.precision({"cpu_flags": ["amx_bf16"]}) == "bf16"
    assert table1.precision({}) == "unknown" and table1.precision(None) == "unknown"
    recs = [{**r, "precision": "bf16"} for r in _synthetic()]
    assert "bf16 for every base and RL cell" in table1.report_markdown(recs, commands={})
    recs[[i for i, r in enumerate(recs) if r["row"] == "scaling"][1]]["precision"] = "fp32"
    assert "bf16 for the base and RL cells but babyai scaling s1 (fp32)." in table1.report_markdown(recs, commands={})


def test_the_paired_row_names_both_rows_seed_counts_when_they_differ():
    tasks = list(range(32))
    recs = _synthetic() + [_record("babyai", "scaling", {"babyai": {"tasks": tasks, "success": [[1.0] * 32],
                                                                    "reward": [[1.0] * 32]}}, seed=2)]
    assert table1.paired_stats(recs, "babyai", "babyai")["seeds"] == (3, 2)
    row = next(ln for ln in table1.report_markdown(recs, commands={}).splitlines()
               if ln.startswith(f"| {table1.PAIRED_TITLE} |"))
    assert "(3 and 2 seeds)" in row
