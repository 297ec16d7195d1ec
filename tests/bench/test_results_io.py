"""Bench records (bench/results_io.py): every field is written, a bench's smoke mode writes one,
smoke records stay out of git and the committed ones carry the fields."""

import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import results_io  # noqa: E402

#: committed before the record had its fields (bench/rollout_scaling.py, 2026-12-06): kept as they are
LEGACY = {"rollout_scaling.json", "rollout_scaling-smollm2.json", "rollout_scaling-smollm2-sync.json"}


def _check_fields(rec: dict, bench: str) -> None:
    assert set(results_io.FIELDS) <= set(rec), set(results_io.FIELDS) - set(rec)
    assert rec["schema"] == results_io.SCHEMA and rec["bench"] == bench
    assert len(rec["git"]["commit"]) == 40 and isinstance(rec["git"]["dirty"], bool)
    m = rec["machine"]
    assert m["cpu_model"] and m["cores"] >= 1 and m["usable_cores"] >= 1 and m["ram_gib"] > 0
    assert "torch_threads" in m and m["python"] and "versions" in m
    assert len(rec["load"]["start"]) == 3 and len(rec["load"]["end"]) == 3
    assert rec["date"].endswith("Z") and rec["started"] <= rec["date"] and rec["wall_s"] >= 0
    assert isinstance(rec["config"], dict) and rec["command"].startswith("python")
    assert isinstance(rec["repeats"], list)


def test_a_record_has_every_field(tmp_path, monkeypatch):
    monkeypatch.setenv(results_io.RESULTS_ENV, str(tmp_path))
    run = results_io.Run("demo", Namespace(reps=2, quick=False, tag="t1"))
    path = run.write([{"rep": 0, "s": 1.5}, {"rep": 1, "s": 1.25}], {"best_s": 1.25}, extra={"note": "x"})
    assert path == tmp_path / "demo-t1.json"
    rec = json.loads(path.read_text())
    _check_fields(rec, "demo")
    assert rec["tag"] == "t1" and rec["config"] == {"reps": 2, "quick": False, "tag": "t1"}
    assert rec["repeats"] == [{"rep": 0, "s": 1.5}, {"rep": 1, "s": 1.25}]
    assert rec["results"] == {"best_s": 1.25} and rec["note"] == "x"
    with pytest.raises(ValueError, match="replace"):
        run.write([], extra={"git": None})


def test_a_record_is_strict_json(tmp_path, monkeypatch):
    """NaN and infinities (a ratio with no baseline) are written as null: strict JSON readers
    (jq, JavaScript) refuse the bare NaN that Python's json writes by default."""
    import numpy as np

    monkeypatch.setenv(results_io.RESULTS_ENV, str(tmp_path))
    run = results_io.Run("demo", Namespace(tag="nan"))
    path = run.write([{"ratio": float("nan"), "s": np.float64("inf"), "ok": 1.5}], {"rows": [[float("-inf")]]})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    rec = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert rec["repeats"] == [{"ratio": None, "s": None, "ok": 1.5}]
    assert rec["results"] == {"rows": [[None]]}


def test_tags(tmp_path, monkeypatch):
    monkeypatch.setenv(results_io.RESULTS_ENV, str(tmp_path))
    assert results_io.default_tag(Namespace(quick=True)) == "smoke"
    assert results_io.default_tag({"smoke": True, "tag": "try2"}) == "try2-smoke"
    assert results_io.default_tag({"tag": "try2"}) == "try2"
    assert results_io.default_tag({}).endswith("Z")  # the UTC time
    assert results_io.Run("demo").write([], tag="").name == "demo.json"
    with pytest.raises(ValueError):
        results_io.record_path("demo", "../x")


def test_smoke_records_are_ignored_by_git_and_the_others_not():
    def ignored(name: str) -> bool:
        return subprocess.run(["git", "check-ignore", "-q", f"bench/results/{name}"], cwd=ROOT).returncode == 0

    assert not ignored("store_throughput-20261206T120000Z.json") and not ignored("rollout_scaling.json")
    assert ignored("store_throughput-smoke.json") and ignored("time_to_success-s0-smoke.json")
    assert ignored("scaling_curves-x.png") and ignored("tts-state/trl-constrained-s0/progress.json")


@pytest.mark.parametrize("bench", ["env_concurrency", "store_throughput"])
def test_a_bench_smoke_mode_writes_its_record(bench, tmp_path):
    env = {**os.environ, results_io.RESULTS_ENV: str(tmp_path), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, f"bench/{bench}.py", "--quick"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rec = json.loads((tmp_path / f"{bench}-smoke.json").read_text())
    _check_fields(rec, bench)
    assert rec["tag"] == "smoke" and rec["config"]["quick"] is True
    assert rec["repeats"] and rec["results"]["rows"]
    if bench == "store_throughput":  # ours and raw, every read kept
        ops = {r["op"] for r in rec["repeats"]}
        assert {"write", "read", "raw write", "raw read"} <= ops
        assert all(len(r["every_s"]) == rec["config"]["reps"] for r in rec["repeats"] if r["op"].endswith("read"))


def test_committed_records_carry_the_fields():
    tracked = subprocess.run(["git", "ls-files", "bench/results"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    for name in tracked:
        path = ROOT / name
        if path.suffix != ".json" or not path.exists():
            continue
        rec = json.loads(path.read_text())
        if path.name in LEGACY:
            assert "args" in rec and "env" in rec  # its arguments and machine, in the layout of its day
            continue
        _check_fields(rec, rec["bench"])
        assert path.stat().st_size <= results_io.MAX_BYTES, name
