"""Scheduled retraining with a champion, on a real local server + process worker.

The shipped `retrain/nightly` deployment is deployed with an interval schedule instead of its cron
(and a tiny config): it fires on its own; the first run registers the first champion; the second
trains from that champion, evaluates challenger and champion on the same held-out tasks, and --
with margin 1.01, which no score in [0, 1] can clear -- keeps the champion, both scores recorded.
A third, in-process run with a negative margin promotes over the existing champion.
"""

import json
import time

import pytest
from mlflow.tracking import MlflowClient

from agentgym.config import parse_config
from agentgym.registry.champion import ModelRegistry
from local_stack import tiny_config

pytestmark = pytest.mark.slow

MODEL = "retrain-test-policy"
INTERVAL_S = 20


@pytest.fixture(scope="module")
def scheduled(local_stack, model_cache):
    stack = local_stack
    tmp = stack.tmp / "retrain-test"
    cfg = tiny_config(tmp, model_cache, "retrain-test")
    stack.write_config("retrain_test", cfg)

    def edit(spec):
        nightly = next(d for d in spec["deployments"] if d["name"] == "nightly")
        nightly["parameters"].update({"config": "{{ prefect.variables.agentgym_config_retrain_test }}",
                                      "registered_model": MODEL, "margin": 1.01, "k": 2})
        nightly["schedules"] = [{"interval": INTERVAL_S, "active": True}]
        spec["deployments"] = [nightly]

    stack.deploy(stack.prefect_file(edit), "retrain/nightly")
    deployed_at = time.monotonic()
    with stack.client() as c:
        dep = c.read_deployment_by_name("retrain/nightly")
    runs = _wait_completed(stack, dep.id, 2, timeout=300)
    stack.timings["deploy_to_second_retrain_completed_s"] = time.monotonic() - deployed_at
    with stack.client() as c:  # stop the schedule and whatever it queued meanwhile
        from prefect.states import Cancelled

        c.delete_deployment(dep.id)
        for r in _runs(c, dep.id):
            if not r.state.is_final():
                c.set_flow_run_state(r.id, Cancelled(), force=True)
    return stack, parse_config(cfg), runs


def _runs(client, deployment_id):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    return client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
                                 sort=FlowRunSort.EXPECTED_START_TIME_ASC)


def _wait_completed(stack, deployment_id, n, timeout):
    deadline = time.monotonic() + timeout
    while True:
        with stack.client() as c:
            runs = _runs(c, deployment_id)
        bad = [r for r in runs if r.state and r.state.type.value in ("FAILED", "CRASHED")]
        assert not bad, f"{bad[0].state}\n--- worker log ---\n{stack.log('worker', 120)}"
        done = [r for r in runs if r.state and r.state.is_completed()]
        if len(done) >= n:
            return done[:n]
        assert time.monotonic() < deadline, (
            f"{len(done)}/{n} retrain runs completed after {timeout} s: "
            f"{[(r.name, r.state.type.value) for r in runs]}\n--- worker log ---\n{stack.log('worker', 120)}")
        time.sleep(2)


def _retrain_runs(cfg):
    client = MlflowClient(cfg.tracking.tracking_uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    runs = client.search_runs([exp.experiment_id], "tags.`agentgym.kind` = 'retrain'",
                              order_by=["attributes.start_time ASC"])
    return client, runs


def test_schedule_fires_and_first_run_crowns_a_champion(scheduled):
    stack, cfg, runs = scheduled
    assert all(r.auto_scheduled for r in runs)  # created by the scheduler, not by hand
    print("MEASURED", json.dumps({k: round(v, 1) for k, v in stack.timings.items()}))
    client, mlruns = _retrain_runs(cfg)
    first = mlruns[0]
    assert first.info.status == "FINISHED"
    assert first.data.tags["agentgym.decision"] == "promoted"
    assert first.data.tags["agentgym.champion_before"] == "none"
    assert first.data.metrics["promoted"] == 1.0 and "challenger_score" in first.data.metrics
    assert "champion_score" not in first.data.metrics
    v1 = client.get_model_version(MODEL, first.data.tags["agentgym.challenger_version"])
    assert v1.tags["agentgym.decision"] == "promoted" and v1.tags["agentgym.champion_version"] == "none"
    assert v1.source.endswith("checkpoints/step-000001")  # the final checkpoint of the training run


def test_second_run_compares_on_the_same_tasks_and_keeps(scheduled):
    stack, cfg, _ = scheduled
    client, mlruns = _retrain_runs(cfg)
    first, second = mlruns[0], mlruns[1]
    v1 = first.data.tags["agentgym.challenger_version"]
    t, m = second.data.tags, second.data.metrics
    assert t["agentgym.champion_before"] == v1
    # both scores, the rule and the outcome: margin 1.01 keeps any champion
    assert {"challenger_score", "champion_score", "score_delta"} <= set(m)
    assert m["challenger_score"] < m["champion_score"] + 1.01 and m["promoted"] == 0.0
    assert t["agentgym.decision"] == "kept" and t["agentgym.champion_after"] == v1
    # the same held-out tasks (and seed) for both: per-category task counts side by side
    for key in ("keyword/overall/n_tasks", "keyword/keyword/n_tasks"):
        assert m[f"challenger/{key}"] == m[f"champion/{key}"] == 3
    assert second.data.params["eval_seed"] == "0"
    v2 = client.get_model_version(MODEL, t["agentgym.challenger_version"])
    assert v2.tags["agentgym.decision"] == "kept" and v2.tags["agentgym.trained_from"] == f"v{v1}"
    assert float(v2.tags["agentgym.champion_score"]) == pytest.approx(m["champion_score"], abs=1e-4)
    assert str(ModelRegistry(cfg.tracking.tracking_uri).champion(MODEL).version) == v1
    # the decision as Prefect artifacts (keyed, so the UI keeps one history per registered model)
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with stack.client() as c:
        md = c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[f"retrain-{MODEL}"])))
        table = c.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[f"retrain-{MODEL}-scores"])))
    assert md and table
    latest = max(md, key=lambda a: a.created)
    assert "**kept**" in latest.data and f"v{t['agentgym.challenger_version']}" in latest.data
    rows = max(table, key=lambda a: a.created).data
    rows = json.loads(rows) if isinstance(rows, str) else rows
    assert {r["model"] for r in rows} == {"challenger", "champion"}


def test_a_better_or_equal_challenger_is_promoted(scheduled):
    """In-process (temporary Prefect server), on the registry the scheduled runs left."""
    from flows.retrain import retrain

    _, cfg, _ = scheduled
    out = retrain(cfg, registered_model=MODEL, margin=-1.0, k=1)
    assert out["promoted"] and out["decision"] == "promoted" and out["champion_score"] is not None
    reg = ModelRegistry(cfg.tracking.tracking_uri)
    assert str(reg.champion(MODEL).version) == out["challenger_version"] == out["champion_after"]
    old = reg.client.get_model_version(MODEL, out["champion_before"])
    assert old.tags["agentgym.replaced_by"] == f"v{out['challenger_version']}"
