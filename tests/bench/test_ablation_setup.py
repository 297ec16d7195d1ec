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
    elif variant == "renorm":  # the quickstart constrains its replies: the option applies
        assert varied.rollout.action_logprob == "renormalised" and plain.rollout.action_logprob == "policy"
        assert varied.rollout.constrain_actions
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


def _record(schedule: str, seed: int, start: str, success: float) -> dict:
    heldout = [[100.0 * (i + 1), 2.0 * (i + 1), success] for i in range(3 if schedule == "scaling" else 1)]
    return {"schedule": schedule, "variant": "", "seed": seed, "start": start, "date": "2026-12-05",
            "per_task": {str(t): float(t < 64 * success) for t in range(64)},
            "curve": {"steps": [10.0, 20.0], "minutes": [1.0, 2.0], "turns": [5.0, 5.0], "reward": [0.1, 0.2],
                      "format": [0.0, 0.0], "invalid": [0.3, 0.2], "heldout": heldout, "wall": 3.0}}


def test_run_records_keep_earlier_machines_runs_and_only_compare_one_start(tmp_path):
    import run_records

    old = run_records.load_records(tmp_path, "textcraft-warm")
    assert old["runs"] == {} and old["start"] is None
    start = {"fingerprint": "sha256:a", "random_valid": 0.27, "base": 0.0, "after_sft": 0.047}
    first = run_records.merge(old, start, {"r-s0": _record("scaling", 0, "sha256:a", 0.5)})
    run_records.save_records(tmp_path, "textcraft-warm", first)
    # the next machine's MLflow holds only its own run; the committed one stays
    again = run_records.merge(run_records.load_records(tmp_path, "textcraft-warm"), None,
                              {"r-s1": _record("scaling", 1, "sha256:a", 0.25),
                               "x-s0": _record("short", 0, "sha256:b", 0.9)})
    assert set(again["runs"]) == {"r-s0", "r-s1", "x-s0"} and again["start"] == start
    keep, others = run_records.comparable(again)
    assert set(keep) == {"r-s0", "r-s1"} and others == ["x-s0"]


def test_the_report_renders_from_the_committed_records_alone(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ablation, "ROOT", tmp_path)
    data = {"version": 1, "env": "textcraft-warm", "runs": {
        "a": _record("scaling", 0, "sha256:a", 0.5), "b": _record("scaling", 1, "sha256:a", 0.25),
        "c": _record("short", 0, "sha256:a", 0.125), "d": _record("long", 0, "sha256:other", 1.0)},
        "start": {"fingerprint": "sha256:a", "random_valid": 0.27, "base": 0.0, "after_sft": 0.047}}
    path = ablation._render("textcraft-warm", ablation.HORIZONS["textcraft-warm"], data)
    out = capsys.readouterr().out
    assert path.exists() and path.parent == tmp_path / "docs" / "results"
    assert "after SFT 0.047" in out and "Left out, recorded from another start than the current one: d" in out
    assert "| scaling | 5 → 10 → 20 | 2 | 0.375 ± 0.125 | 0.500, 0.250 |" in out
    assert "| scaling − short | +0.250 |" in out and "| long" not in out


def test_a_weights_fingerprint_changes_with_the_weights(tmp_path):
    import run_records

    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 10)
    (tmp_path / "config.json").write_text("{}")
    a = run_records.weights_fingerprint(tmp_path)
    (tmp_path / "config.json").write_text('{"x": 1}')
    assert run_records.weights_fingerprint(tmp_path) == a
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 9 + b"\x01")
    assert run_records.weights_fingerprint(tmp_path) != a
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .*weight files"):
        run_records.weights_fingerprint(tmp_path / "empty")


@pytest.mark.parametrize("keep_state", [True, False])
def test_the_resume_check_runs_the_ablation_config_but_for_what_it_varies(tmp_path, keep_state):
    import resume_check

    cmd = resume_check.command(tmp_path, "exact", tmp_path / "sft", keep_state)
    cfg = load_config(Path(cmd[cmd.index("-c") + 1]), cmd[cmd.index("--set") + 1::2])
    ablation_cfg = load_config(ablation.config_path("textcraft-warm"), [])
    assert cfg.tracking.checkpoint_trainer_state is keep_state and ablation_cfg.tracking.checkpoint_trainer_state
    assert cfg.tracking.checkpoint_every == resume_check.EVERY < sum(s.iterations for s in cfg.stages)
    assert cfg.trainer == ablation_cfg.trainer and cfg.algorithm == ablation_cfg.algorithm
    assert not cfg.heldout.enabled and str(tmp_path) in cfg.tracking.tracking_uri
