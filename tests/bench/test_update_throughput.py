"""bench/update_throughput.py (issue 44 item 2): the median / spread / ratio arithmetic against
closed forms, the alternation order, and smoke runs at the tiny model that write a record with
every side's repeats and the checkpointing and layers settings."""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import results_io  # noqa: E402
import update_throughput as ut  # noqa: E402

TRL_PY = ut.TRL_VENV / "bin" / "python"


def test_summarize_is_the_median_and_the_range():
    assert ut.summarize([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert ut.summarize([4.0, 1.0, 3.0, 2.0]) == {"median": 2.5, "min": 1.0, "max": 4.0, "n": 4}
    assert ut.summarize([7.0]) == {"median": 7.0, "min": 7.0, "max": 7.0, "n": 1}
    with pytest.raises(ValueError):
        ut.summarize([])


def test_report_ratios_are_per_repeat_baseline_over_ours():
    # ours takes 1, 2, 4 s; plain 2, 2, 2 s; trl 3, 8, 4 s -> ours/plain = 2, 1, 0.5; ours/trl = 3, 4, 1
    secs = {"ours": [1.0, 2.0, 4.0], "plain": [2.0, 2.0, 2.0], "trl": [3.0, 8.0, 4.0]}
    repeats = [{"rep": i, "side": side, "s": s} for side, ss in secs.items() for i, s in enumerate(ss)]
    out = ut.report(repeats, tokens=8)
    assert out["ratios"]["ours/plain"] == {"median": 1.0, "min": 0.5, "max": 2.0, "n": 3, "per_repeat": [2.0, 1.0, 0.5]}
    assert out["ratios"]["ours/trl"] == {"median": 3.0, "min": 1.0, "max": 4.0, "n": 3, "per_repeat": [3.0, 4.0, 1.0]}
    assert out["sides"]["ours"]["s"] == {"median": 2.0, "min": 1.0, "max": 4.0, "n": 3}
    assert out["sides"]["ours"]["tok_s"] == {"median": 4.0, "min": 2.0, "max": 8.0, "n": 3}  # 8 tokens / s
    assert out["sides"]["trl"]["tok_s"]["median"] == pytest.approx(8 / 4)


def test_every_side_leads_in_turn():
    orders = [ut.order_for(i, ut.SIDES) for i in range(3)]
    assert orders == [["ours", "plain", "trl"], ["plain", "trl", "ours"], ["trl", "ours", "plain"]]
    for pos in range(3):  # over 3 repeats each side takes each position once
        assert sorted(o[pos] for o in orders) == sorted(ut.SIDES)
    assert ut.order_for(3, ut.SIDES) == orders[0]
    assert ut.order_for(1, ["ours", "plain"]) == ["plain", "ours"]


def test_layers_and_the_trl_venv_interface():
    assert ut.train_layers("all") is None and ut.train_layers("top8") == 8
    with pytest.raises(SystemExit):
        ut._parse(["--layers", "bottom3"])
    a = ut._parse([])
    assert a.checkpointing == "off" and a.layers == "all" and a.repeats == 5
    # bench/time_to_success.py builds its TRL venv with these
    assert list(inspect.signature(ut.ensure_trl_venv).parameters) == ["torch_index"]
    assert any(p.startswith("trl==") for p in ut.TRL_PINS)


def _run(tmp_path: Path, *extra: str) -> dict:
    env = {**os.environ, results_io.RESULTS_ENV: str(tmp_path), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "bench/update_throughput.py", "--quick", "--checkpointing", "on", "--layers", "top1",
           "--tag", "t", *extra]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads((tmp_path / "update_throughput-t-smoke.json").read_text())


def _check(rec: dict, sides: list[str]) -> None:
    assert rec["bench"] == "update_throughput"
    c = rec["config"]
    assert c["checkpointing"] == "on" and c["layers"] == "top1" and c["threads"] == 1 and c["repeats"] == 2
    res = rec["results"]
    assert res["checkpointing"] is True and res["train_layers"] == 1 and res["layers_in_model"] == 2
    assert sorted(res["sides_checked"]) == sorted(sides)
    counts = {s["trainable_params"] for s in res["sides_checked"].values()}
    assert len(counts) == 1 and all(s["checkpointing"] is True for s in res["sides_checked"].values())
    for side in sides:  # every repeat of every side, in the order of its repeat
        reps = [r for r in rec["repeats"] if r["side"] == side]
        assert [r["rep"] for r in reps] == [0, 1] and all(r["s"] > 0 and r["tok_s"] > 0 for r in reps)
        assert all(r["order"][r["position"]] == side for r in reps)
        assert res["sides"][side]["s"]["n"] == 2 and set(res["warmup_s"]) == set(sides)
    assert [r["order"][0] for r in rec["repeats"] if r["position"] == 0] == [sides[0], sides[1]]
    for base in sides[1:]:
        r = res["ratios"][f"ours/{base}"]
        assert r["min"] <= r["median"] <= r["max"] and len(r["per_repeat"]) == 2
    assert [row["metric"] for row in res["rows"]][0] == "ours vs plain PyTorch"


def test_smoke_ours_and_plain_write_every_repeat(tmp_path):
    _check(_run(tmp_path, "--no-trl"), ["ours", "plain"])


@pytest.mark.slow
@pytest.mark.skipif(not TRL_PY.exists(), reason="bench/.venv-trl not created (python bench/update_throughput.py "
                    "creates it, ~2 min with the registry)")
def test_smoke_with_trl_writes_every_repeat(tmp_path):
    rec = _run(tmp_path, "--with-trl")
    _check(rec, ["ours", "plain", "trl"])
    assert rec["results"]["sides_checked"]["trl"]["trl"] == "1.16.0"
