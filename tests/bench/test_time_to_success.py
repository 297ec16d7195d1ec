"""bench/time_to_success.py's pure parts and plumbing (issue 44 item 1): every arm follows ours'
horizon schedule, the rollout_func's output is the played episodes' tokens, the one evaluator
scores an HF folder and caches it, the report's ratio and interval come out of synthetic records
as computed by hand. The TRL child itself (bench/tts_trl.py in bench/.venv-trl) runs on the tiny
model where that venv exists (slow lane); without it those tests are skipped."""

import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import results_io  # noqa: E402
import tts_eval  # noqa: E402
import tts_report as R  # noqa: E402
import tts_trl  # noqa: E402

TRL_PY = ROOT / "bench" / ".venv-trl" / "bin" / "python"
QUICKSTART = [{"horizon": 2, "iterations": 6}, {"horizon": 3, "iterations": 6}, {"horizon": 4, "iterations": 6},
              {"horizon": 5, "iterations": 6}]


# ----------------------------------------------------------------------------- the schedule


def test_the_quickstart_schedule_by_iteration():
    import time_to_success as tts

    assert tts.quickstart_stages() == QUICKSTART  # the bench reads the quickstart's own stages
    assert [R.horizon_at(QUICKSTART, i) for i in range(24)] == [2] * 6 + [3] * 6 + [4] * 6 + [5] * 6
    assert R.horizon_at(QUICKSTART, 30) == 5 and R.stage_ends(QUICKSTART) == [6, 12, 18, 24]
    with pytest.raises(ValueError):
        R.horizon_at(QUICKSTART, -1)
    budget = tts.make_budget(smoke=False)
    assert budget.stages == QUICKSTART and budget.iterations == 24 and budget.per_iteration == 32
    assert len(budget.heldout_tasks) == 64 and tts.HELDOUT_HORIZON == 5


def test_the_ours_arm_and_a_trl_arm_read_the_same_settings():
    import time_to_success as tts

    budget = tts.make_budget(smoke=True)
    cfg = tts.ours_config(budget, seed=3)
    assert [(s.horizon, s.iterations) for s in cfg.stages] == [(2, 1), (5, 1)] and cfg.seed == 3
    assert cfg.rollout.max_draws == 1 and cfg.envs[0].eval_tasks == budget.heldout_tasks
    args = Namespace(seed=3, threads=1, trl_save_every=3)
    spec = tts.trl_spec("choose", budget, args, "/m", Path("/s"))
    assert spec["stages"] == budget.stages and spec["eval_at"] == [1, 2] and spec["iterations"] == 2
    assert spec["mini_batches"] == cfg.algorithm.mini_batches and spec["learning_rate"] == cfg.trainer.learning_rate
    assert spec["train_layers"] == cfg.trainer.train_layers and spec["train_tasks"] == cfg.envs[0].tasks
    assert spec["rollout_settings"]["constrain_actions"] is True  # the quickstart's constrained choice
    assert spec["rollout_settings"]["system_prompt"] == cfg.system_prompt
    assert {"bf16", "engine_dtype"} <= set(spec)


@pytest.mark.parametrize("mode", ["choose", "env"])
def test_the_trainer_follows_the_schedule_before_each_generation(mode):
    spec = {"mode": mode, "mini_batches": 2, "stages": [{"horizon": 2, "iterations": 2}, {"horizon": 5, "iterations": 1}]}
    state = {"horizons": []}
    rollout = SimpleNamespace(horizon=None, iteration=None) if mode == "choose" else None
    trainer = SimpleNamespace(state=SimpleNamespace(global_step=0), max_tool_calling_iterations=99)
    seen = []
    for step in range(6):  # two optimizer steps an iteration; TRL generates at the first of each
        trainer.state.global_step = step
        if step % 2 == 0:
            seen.append(tts_trl.follow_schedule(trainer, spec, state, rollout))
            if mode == "env":
                assert trainer.max_tool_calling_iterations == seen[-1]
            else:
                assert (rollout.horizon, rollout.iteration) == (seen[-1], step // 2)
            assert state["horizon"] == seen[-1]
    assert seen == [2, 2, 5] and state["horizons"] == [[0, 2], [1, 2], [2, 5]]
    tts_trl.follow_schedule(trainer, spec, state, rollout)  # again within iteration 2: recorded once
    assert state["horizons"] == [[0, 2], [1, 2], [2, 5]]


def test_the_tool_environment_caps_its_steps_at_the_current_horizon():
    schedule = {"horizon": 1}
    env = tts_trl.tool_env_class({"observation_style": "compact"}, schedule)()
    obs = env.reset(task_id=0)
    assert "go to" in obs.lower()
    env.act("turn left")
    assert env.over and env.act("turn left") == "The episode is over."
    schedule["horizon"] = 3  # the next iteration's horizon
    env.reset(task_id=0)
    env.act("turn left")
    env.act("turn left")
    assert not env.over or env.success
    assert 0.0 <= env.get_reward() <= 1.0


# ----------------------------------------------------------------------------- the rollout_func's output


def test_episodes_become_trl_rows_with_the_policy_tokens_masked_in():
    from agentgym.types import Episode

    ep = Episode("g-e0", "g", "babyai", 0, 0, 2, reward=1.0, success=True)
    ep.append([1, 2, 3], sampled=False)  # the prompt and the forced "Action:"
    ep.append([10, 11], sampled=True, logprobs=[-0.5, -0.25])  # the first reply
    ep.append([4, 5], sampled=False)  # glue and the observation
    ep.append([12], sampled=True, logprobs=[-1.0])
    out = tts_trl.to_trl([ep])
    assert out["prompt_ids"] == [[1, 2, 3]] and out["completion_ids"] == [[10, 11, 4, 5, 12]]
    assert out["env_mask"] == [[1, 1, 0, 0, 1]] and out["logprobs"] == [[-0.5, -0.25, 0.0, 0.0, -1.0]]
    assert out["env_reward"] == [1.0] and out["env_success"] == [1.0]
    ep.context_starts = [3]
    with pytest.raises(ValueError, match="context"):
        tts_trl.to_trl([ep])


def test_a_generation_batch_becomes_ours_groups():
    specs = tts_trl.episode_specs([7, 7, 9, 9], iteration=4, group_size=2, seed=1, env_kwargs={"a": 1})
    assert [s.group_id for s in specs] == ["s4-g0-babyai-7"] * 2 + ["s4-g1-babyai-9"] * 2
    assert [s.episode_id for s in specs][:2] == ["s4-g0-babyai-7-e0", "s4-g0-babyai-7-e1"]
    assert {s.seed for s in specs} == {1} and specs[0].env_kwargs == {"a": 1}
    with pytest.raises(ValueError):
        tts_trl.episode_specs([7, 9, 9, 9], iteration=0, group_size=2, seed=0, env_kwargs={})


# ----------------------------------------------------------------------------- the one evaluator


def test_the_evaluator_scores_an_hf_folder_and_caches_it(tiny_path, tmp_path, monkeypatch):
    from agentgym.config import load_config

    cfg = load_config(tts_eval.CONFIG, tts_eval.heldout_overrides(str(tiny_path), [4000, 4001], 2))
    assert cfg.envs[0].eval_tasks == [4000, 4001] and cfg.heldout.horizon == 2
    out = tts_eval.score(tiny_path, [4001, 4000], horizon=2)  # the real evaluation, on the tiny model
    assert len(out["tasks"]) == 2 and set(out["tasks"]) <= {0.0, 1.0}
    assert out["success"] == pytest.approx(sum(out["tasks"]) / 2) and out["horizon"] == 2

    calls = []
    monkeypatch.setattr(tts_eval, "score", lambda f, t, h: calls.append(f) or {"success": 0.5, "tasks": [1.0, 0.0],
                                                                               "seconds": 0.0})
    folder = tmp_path / "iter-1"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x")
    sc = tts_eval.Scores(tmp_path / "scores.json")
    assert sc.score(folder, [1, 2], 5)["success"] == 0.5
    assert tts_eval.Scores(tmp_path / "scores.json").score(folder, [1, 2], 5)["success"] == 0.5  # from the file
    assert len(calls) == 1
    (folder / "model.safetensors").write_bytes(b"yy")  # the folder written again: scored again
    sc.score(folder, [1, 2], 5)
    assert len(calls) == 2


# ----------------------------------------------------------------------------- the report


def _points(successes: list[float], times: list[float], steps: int = 48) -> list[dict]:
    out = []
    for k, (s, t) in enumerate(zip(successes, times)):
        n = round(s * 4)
        out.append({"label": "base" if k == 0 else f"p{k}", "iterations": 6 * k, "episodes": 192 * k,
                    "train_s": t, "success": s, "optimizer_steps": steps * k // (len(times) - 1),
                    "rollout_s": t / 2, "update_s": t / 3, "tasks": [1.0] * n + [0.0] * (4 - n)})
    return out


def _write(folder: Path, arm: str, seed: int, points: list[dict], tag: str = "t", smoke: bool = False) -> None:
    res = {"kind": "arm", "arm": arm, "seed": seed, "tag": tag, "smoke": smoke, "points": points}
    results_io.Run(R.BENCH, {}).write([], res, tag=R.record_tag(tag, arm, seed, smoke))


def test_the_ratio_of_training_times_and_its_interval(tmp_path, monkeypatch):
    monkeypatch.setenv(results_io.RESULTS_ENV, str(tmp_path))
    # seed 0: ours ends at 0.75, TRL at 0.5 -> target 0.5: ours reaches it at 10 s, TRL at 100 s
    _write(tmp_path, "ours", 0, _points([0.0, 0.5, 0.75], [0, 10, 20], steps=40))
    _write(tmp_path, "trl-choose", 0, _points([0.0, 0.25, 0.5], [0, 50, 100]))
    # seed 1: TRL ends higher -> target = ours' final 0.5: ours at 30 s, TRL at 30 s
    _write(tmp_path, "ours", 1, _points([0.0, 0.25, 0.5], [0, 15, 30]))
    _write(tmp_path, "trl-choose", 1, _points([0.0, 0.5, 1.0], [0, 30, 60]))
    # seed 2: TRL never leaves the base -> not informative
    _write(tmp_path, "ours", 2, _points([0.0, 0.5, 0.5], [0, 10, 20]))
    _write(tmp_path, "trl-choose", 2, _points([0.0, 0.0, 0.0], [0, 50, 100]))
    _write(tmp_path, "trl-env", 0, _points([0.0, 0.0, 0.0], [0, 50, 100]))
    _write(tmp_path, "ours", 0, _points([0.0, 1.0, 1.0], [0, 1, 2]), tag="other")  # another tag: not read
    _write(tmp_path, "ours", 5, _points([0.0, 1.0, 1.0], [0, 1, 2]), smoke=True)  # a smoke: not read
    recs = R.load_records(tmp_path, "t", smoke=False)
    assert {a: sorted(s) for a, s in recs.items()} == {"ours": [0, 1, 2], "trl-choose": [0, 1, 2], "trl-env": [0]}

    c = R.comparison(recs, "trl-choose")
    by_seed = {s["seed"]: s for s in c["per_seed"]}
    assert (by_seed[0]["target"], by_seed[0]["t_ours"], by_seed[0]["t_trl"]) == (0.5, 10, 100)
    assert (by_seed[1]["target"], by_seed[1]["t_ours"], by_seed[1]["t_trl"]) == (0.5, 30, 30)
    assert not by_seed[2]["informative"] and c["informative_seeds"] == [0, 1]
    ratio, lo, hi = c["ratio"]
    assert ratio == pytest.approx(40 / 130)  # ratio of the mean times over the informative seeds
    assert lo == pytest.approx(10 / 100) and hi == pytest.approx(1.0)  # the resamples (0,0) and (1,1)
    assert c["arms"]["ours"]["optimizer_steps"] == pytest.approx((40 + 48 + 48) / 3)
    d, dlo, dhi = c["final_difference"]
    assert d == pytest.approx((0.75 + 0.5 + 0.5 - 0.5 - 1.0 - 0.0) / 3) and dlo <= d <= dhi
    text = "\n".join(R.report_lines([c], recs))
    assert "ours vs trl-choose" in text and "left out of the ratio" in text and "0.308x" in text

    env = R.comparison(recs, "trl-env")
    assert env["ratio"] is None and "no time-to-success ratio" in R.verdict(env)
    assert R.comparison(recs, "nobody") is None


def test_the_verdict_says_which_way_it_came_out():
    base = {"trl_arm": "trl-choose", "informative_seeds": [0, 1, 2]}
    assert "ours faster" in R.verdict({**base, "ratio": (0.4, 0.2, 0.8)})
    assert "trl-choose faster" in R.verdict({**base, "ratio": (2.0, 1.5, 3.0)})
    assert "contains 1" in R.verdict({**base, "ratio": (0.9, 0.5, 1.4)})
    assert R.ratio_interval([5, 5, 5], [5, 5, 5]) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError):
        R.ratio_interval([1.0], [1.0, 2.0])


def test_report_mode_reads_the_records_and_writes_its_own(tmp_path):
    env = {**os.environ, results_io.RESULTS_ENV: str(tmp_path)}
    for seed in (0, 1, 2):
        for arm, t in (("ours", 10.0), ("trl-choose", 40.0)):
            res = {"kind": "arm", "arm": arm, "seed": seed, "tag": "r", "smoke": False,
                   "points": _points([0.0, 0.5, 0.75], [0, t, 2 * t])}
            (tmp_path / f"time_to_success-{R.record_tag('r', arm, seed, False)}.json").write_text(
                json.dumps({"results": res}))
    out = subprocess.run([sys.executable, "bench/time_to_success.py", "--report", "--tag", "r"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ours needed 0.250x trl-choose's training time" in out.stdout and "ours faster" in out.stdout
    rec = json.loads((tmp_path / "time_to_success-r-report.json").read_text())
    assert rec["results"]["kind"] == "report" and rec["results"]["comparisons"][0]["ratio"][0] == pytest.approx(0.25)


# ----------------------------------------------------------------------------- the TRL child (bench/.venv-trl)


def _trl_venv_ready() -> bool:
    if not TRL_PY.exists():
        return False
    return subprocess.run([str(TRL_PY), "-c", "import trl, minigrid"], capture_output=True).returncode == 0


needs_trl = pytest.mark.skipif(not _trl_venv_ready(), reason="bench/.venv-trl (TRL 1.16 + minigrid) is not built: "
                               "`python bench/time_to_success.py --smoke` builds it")


@needs_trl
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["choose", "env"])
def test_the_trl_child_follows_the_schedule_and_saves_each_point(mode, tiny_path, tmp_path):
    import time_to_success as tts

    budget = tts.Budget([{"horizon": 1, "iterations": 1}, {"horizon": 2, "iterations": 1}], 2, 2, [4000, 4001])
    spec = tts.trl_spec(mode, budget, Namespace(seed=0, threads=1, trl_save_every=5), str(tiny_path), tmp_path)
    spec["train_layers"] = 1
    (tmp_path / "spec.in.json").write_text(json.dumps(spec))
    env = {**tts.thread_env(1), "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'bench'}", "TRL_EXPERIMENTAL_SILENCE": "1"}
    out = subprocess.run([str(TRL_PY), "bench/tts_trl.py", str(tmp_path / "spec.in.json")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["horizons"] == [[0, 1], [1, 2]] and res["optimizer_steps"] == 4
    assert res["settings"]["gradient_checkpointing"] is False and res["settings"]["model_gradient_checkpointing"] is False
    assert [p["iterations"] for p in res["points"]] == [1, 2] and [p["optimizer_steps"] for p in res["points"]] == [2, 4]
    for p in res["points"]:
        assert p["train_s"] > 0 and 0 < p["rollout_s"] and p["update_s"] > 0
        assert (Path(p["folder"]) / "config.json").exists()
    assert res["points"][1]["train_s"] > res["points"][0]["train_s"]
    # the saved folder carries the base model's own tokenizer (the evaluator's format), and scores
    folder = Path(res["points"][-1]["folder"])
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(folder).chat_template == AutoTokenizer.from_pretrained(tiny_path).chat_template
    assert len(tts_eval.score(folder, budget.heldout_tasks, 2)["tasks"]) == 2
