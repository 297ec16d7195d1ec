"""schedule.max_env_steps: the run ends after the iteration that spends the environment-step
budget, mid-stage or at a stage's end; the policy there is the one evaluated held out, and a
re-run of the finished run trains nothing more."""

import pytest
from mlflow.tracking import MlflowClient

from configs import keyword_env, parse_tiny_config  # tests/ is on sys.path

# single-turn keyword tasks: 2 tasks x 2 samples = 4 environment steps per iteration, at any horizon
STAGES = [{"horizon": 1, "iterations": 2}, {"horizon": 2, "iterations": 3}, {"horizon": 3, "iterations": 2}]


def _run(tmp, model_cache, budget, run_id):
    from flows.train import scaling_inter_rl

    cfg = parse_tiny_config(
        model_cache, store_root=tmp / "store", tracking_dir=tmp, run_id=run_id, seed=2,
        envs=[keyword_env(eval_tasks=[7])], schedule={"stages": STAGES, "max_env_steps": budget},
        heldout={"enabled": True, "base": False, "random_seeds": 1},
        tracking={"experiment": "budget", "checkpoint_every": 1})
    return cfg, scaling_inter_rl(cfg)


def _history(cfg, parent, key="env_steps"):
    client = MlflowClient(tracking_uri=cfg.tracking.tracking_uri)
    return {m.step: m.value for m in client.get_metric_history(parent, key)}


@pytest.mark.parametrize(("budget", "end_step", "stage"), [(10, 3, 1), (8, 2, 0)])
def test_the_run_ends_at_the_iteration_that_spends_the_budget(tmp_path, model_cache, budget, end_step, stage):
    cfg, result = _run(tmp_path, model_cache, budget, f"budget-{budget}")
    steps = _history(cfg, result["mlflow_run_id"])
    assert sorted(steps) == list(range(end_step)) and set(steps.values()) == {4.0}
    assert sum(steps.values()) >= budget > sum(steps.values()) - 4  # the last iteration crossed it
    last = result["stages"][-1]
    assert len(result["stages"]) == stage + 1 and last["budget_spent"] and last["end_step"] == end_step
    assert last["env_steps"] == sum(steps.values())
    assert {r["policy"] for r in result["heldout"]} >= {f"stage-{stage}"}  # scored where it stopped
    from agentgym.tracking.tracker import Tracker

    tracker = Tracker.from_config(cfg.tracking)
    assert tracker.latest_checkpoint(cfg.run_id).global_step == end_step  # the policy where it stopped
    assert tracker.run_checkpoint(last["mlflow_run_id"]) == last["checkpoint"]
    if stage == 1:  # a re-run of the finished run resumes at the budget's checkpoint and trains nothing
        _, again = _run(tmp_path, model_cache, budget, f"budget-{budget}")
        assert again["resumed_from_step"] == end_step
        assert _history(cfg, result["mlflow_run_id"]) == steps
        assert again["stages"][-1]["budget_spent"] and len(again["stages"]) == 2


def test_no_budget_runs_every_stage(tmp_path, model_cache):
    cfg, result = _run(tmp_path, model_cache, None, "budget-none")
    assert sorted(_history(cfg, result["mlflow_run_id"])) == list(range(7))
    assert [s["budget_spent"] for s in result["stages"]] == [False, False, False]


def test_a_budget_with_async_rollouts_is_refused():
    from agentgym.config import ConfigError, parse_config

    with pytest.raises((ConfigError, ValueError), match="rollout.async_steps: 0 or schedule.max_env_steps: null"):
        parse_config({"schedule": {"stages": [{"horizon": 1, "iterations": 1}], "max_env_steps": 5},
                      "rollout": {"async_steps": 1}, "algorithm": {"recompute_old_logprobs": False}})


def test_the_summary_says_the_budget_ended_the_run(capsys):
    from agentgym_cli.cli import _print_summary

    stage = {"stage": 0, "horizon": 2, "iterations": 5, "iterations_done": 3, "success_rate": 0.5,
             "final_success_rate": 0.5, "reward_mean": 0.5, "end_step": 3, "env_steps": 12.0, "budget_spent": True,
             "checkpoint": "file:///c"}
    _print_summary({"run_id": "r", "stages": [stage], "store": "s", "tracking_uri": "t", "experiment": "e",
                    "mlflow_run_id": "m"}, 60.0)
    out = capsys.readouterr().out
    assert "3 of 5" in out and "12 environment steps by step 3" in out
    _print_summary({"run_id": "r", "stages": [{**stage, "iterations_done": 5, "budget_spent": False}], "store": "s",
                    "tracking_uri": "t", "experiment": "e", "mlflow_run_id": "m"}, 60.0)
    assert "budget" not in capsys.readouterr().out
