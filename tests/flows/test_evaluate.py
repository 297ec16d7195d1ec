"""Flow ``evaluate-policy`` and tasks ``evaluate_model`` / ``evaluate_live_run`` on a temporary Prefect server, real MLflow."""

import pytest
from mlflow.tracking import MlflowClient
from prefect import flow

from agentgym.registry.champion import ModelRegistry
from agentgym.tracking.tracker import TAG_KIND, Tracker
from configs import DEFAULT, parse_tiny_config  # tests/ is on sys.path
from local_stack import own_artifact_root


def _config(tmp, cache):
    # evaluation only: the library's rollout batch shape and trainer
    return parse_tiny_config(
        cache, store_root=tmp / "store", tracking_dir=tmp, seed=1,
        envs=[{"name": "keyword", "tasks": [0], "eval_tasks": [5, 6, 7], "kwargs": {"target": "yes"}},
              {"name": "babyai", "tasks": [0], "eval_tasks": [0, 12]}],
        rollout={"tasks_per_iteration": DEFAULT, "group_size": DEFAULT, "max_context_tokens": 2048},
        trainer=DEFAULT, schedule={"stages": [{"horizon": 2, "iterations": 1}]}, tracking={"experiment": "eval-test"})


@pytest.fixture(scope="module")
def registered(tmp_path_factory, tiny_path, model_cache):
    """The tiny model logged as a checkpoint and registered as models:/eval-policy@champion."""
    tmp = tmp_path_factory.mktemp("evalflow")
    cfg = _config(tmp, model_cache)
    own_artifact_root(cfg.tracking.tracking_uri, cfg.tracking.experiment, tmp / "mlartifacts")
    tracker = Tracker(cfg.tracking.tracking_uri, cfg.tracking.experiment)
    run = tracker.client.create_run(tracker.experiment_id).info.run_id
    ckpt = tracker.log_checkpoint(run, tiny_path, step=2)
    reg = ModelRegistry(cfg.tracking.tracking_uri)
    version = reg.register("eval-policy", ckpt, run_id=run)
    reg.set_alias("eval-policy", version.version)
    return cfg, ckpt


def _artifact(key):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    assert found, f"no Prefect artifact {key!r}"
    return found[0]


def test_evaluate_policy_on_a_registered_model(registered):
    from flows.evaluate import evaluate_policy

    cfg, _ = registered
    state = evaluate_policy(cfg, model="models:/eval-policy@champion", k=2, greedy_too=True, return_state=True)
    assert state.is_completed()
    out = state.result()
    client = MlflowClient(cfg.tracking.tracking_uri)
    run = client.get_run(out["mlflow_run_id"])
    assert run.data.tags[TAG_KIND] == "evaluation" and run.info.status == "FINISHED"
    m = run.data.metrics
    for key in ("eval/keyword/keyword/avg_at_2", "eval/keyword/keyword/pass_at_2", "eval/keyword/overall/greedy_at_1",
                "eval/babyai/GoTo/avg_at_2", "eval/babyai/Open/pass_at_2", "eval/babyai/overall/avg_at_2",
                "eval/overall/avg_at_2", "eval/overall/greedy_at_1"):
        assert key in m and 0.0 <= m[key] <= 1.0, key
    assert m["eval/keyword/overall/n_tasks"] == 3 and m["eval/babyai/overall/n_tasks"] == 2
    assert m["eval/overall/avg_at_2"] == pytest.approx(out["score"])
    assert out["sampled"]["k"] == 2 and out["greedy"]["k"] == 1
    art = _artifact("eval-policy-models-eval-policy-champion")
    assert art.type == "table"
    rows = art.data if isinstance(art.data, list) else __import__("json").loads(art.data)
    assert {(r["env"], r["category"]) for r in rows} == {
        ("keyword", "keyword"), ("keyword", "overall"), ("babyai", "GoTo"), ("babyai", "Open"), ("babyai", "overall")}
    assert {"avg@2", "pass@2", "greedy@1"} <= set(rows[0])


def test_same_seed_same_scores_for_folder_and_uri(registered, tiny_path):
    """A checkpoint URI and the folder it came from are the same policy: identical reports."""
    from tasks.evaluation import EvalSettings, EvalSink, evaluate_model

    cfg, ckpt = registered
    same, quiet = EvalSettings(k=2, seed=4), EvalSink(publish=False)

    @flow
    def both():
        a = evaluate_model(cfg, ckpt, same, quiet)
        b = evaluate_model(cfg, str(tiny_path), same, quiet)
        return a, b

    a, b = both()
    assert a["sampled"]["tasks"] == b["sampled"]["tasks"]
    assert a["local_path"] != b["local_path"]


def test_evaluate_live_run_on_a_live_training_session(registered):
    """What the training flow calls every ``eval_every`` steps: its session, metrics at the step."""
    from tasks.evaluation import EvalSettings, EvalSink, evaluate_live_run
    from tasks.runtime import drop_session, get_session

    cfg, _ = registered
    tracker = Tracker(cfg.tracking.tracking_uri, cfg.tracking.experiment)
    run = tracker.client.create_run(tracker.experiment_id).info.run_id

    @flow
    def training_like():
        session = get_session(cfg, "live-run", create=True)
        try:
            out = evaluate_live_run(cfg, "live-run", EvalSettings(k=1), EvalSink(mlflow_run_id=run, step=3))
            assert get_session(cfg, "live-run") is session  # evaluated in place, nothing reloaded
            return out
        finally:
            drop_session("live-run")

    out = training_like()
    hist = MlflowClient(cfg.tracking.tracking_uri).get_metric_history(run, "eval/overall/avg_at_1")
    assert [h.step for h in hist] == [3] and hist[0].value == pytest.approx(out["score"])
    assert _artifact("eval-live-run-step-3").type == "table"


def test_evaluate_policy_needs_eval_tasks(registered):
    from flows.evaluate import evaluate_policy

    cfg, _ = registered
    with pytest.raises(ValueError, match="eval_tasks"):
        evaluate_policy(cfg, model="tiny", overrides=["envs.0.eval_tasks=[]", "envs.1.eval_tasks=[]"])


def test_cli_eval_run_and_champion(registered, tmp_path):
    import yaml
    from typer.testing import CliRunner

    from agentgym_cli.eval_cmd import eval_app

    cfg, _ = registered
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
    runner = CliRunner()
    out = runner.invoke(eval_app, ["run", "models:/eval-policy@champion", "-c", str(path), "--k", "1",
                                   "--no-greedy", "--set", "envs.1.eval_tasks=[23]"])
    assert out.exit_code == 0, out.output
    assert "Unlock" in out.output and "avg@1" in out.output and "MLflow run" in out.output
    out = runner.invoke(eval_app, ["champion", "--name", "eval-policy", "--tracking-uri", cfg.tracking.tracking_uri])
    assert out.exit_code == 0, out.output
    assert "champion: v1" in out.output
    bad = runner.invoke(eval_app, ["run", "tiny", "-c", str(path), "--set", "rollout.group_sise=2"])
    assert bad.exit_code == 2


def test_evaluating_a_run_with_no_live_session_says_how_to_resume(registered):
    from tasks.evaluation import EvalSettings, evaluate_live_run

    cfg, _ = registered

    @flow
    def orphan():
        return evaluate_live_run(cfg, "never-started", EvalSettings(k=1))

    with pytest.raises(RuntimeError, match="no live policy session for run 'never-started'.*same run id"):
        orphan()
