"""deployments/local.sh + deployments/prefect.yaml against a real local server and process worker.

What a user types -- `local.sh start`, `local.sh deploy`, `prefect deployment run ... --param` --
with tiny configs in place of configs/*.yaml (AGENTGYM_CONFIG_DIR), then the run is followed to
completion and its parameters are checked where they land (MLflow params, the trajectory store).
"""

import json
import re
import time
from datetime import datetime, timezone

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from local_stack import ROOT, tiny_config

pytestmark = pytest.mark.slow

# every shipped config but the smoke one has a training deployment (tests/flows/test_prefect_yaml.py)
CONFIG_NAMES = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml") if p.stem != "tiny-keyword")
DEPLOYMENTS = {f"scaling-inter-rl/{name}" for name in CONFIG_NAMES} | {"retrain/nightly", "evaluate-policy/champion"}


@pytest.fixture(scope="module")
def deployed(local_stack, model_cache):
    tmp = local_stack.tmp / "deploy-test"
    cfgs = {name: tiny_config(tmp, model_cache, f"deploy-{name}") for name in CONFIG_NAMES}
    # the quickstart deployment's config uses the rounds shorthand: test_run_with_overrides
    # replaces it with schedule.stages through the run's overrides, as `agentgym train --set` does
    cfgs["quickstart"]["schedule"] = {"rounds": [2], "steps_per_stage": 1}
    for name, cfg in cfgs.items():
        local_stack.write_config(name, cfg)
    t0 = time.perf_counter()
    out = local_stack.deploy()  # the shipped deployments/prefect.yaml, all of it
    local_stack.timings["deploy_all_s"] = time.perf_counter() - t0
    assert "variable agentgym_config_quickstart" in out.stdout
    return local_stack, cfgs, tmp


def test_start_is_idempotent(local_stack):
    pids = {n: (local_stack.state / f"{n}.pid").read_text() for n in ("server", "worker")}
    out = local_stack.sh("start")
    assert "server already running" in out.stdout and "worker already running" in out.stdout
    assert pids == {n: (local_stack.state / f"{n}.pid").read_text() for n in ("server", "worker")}
    assert "server: up" in local_stack.sh("status").stdout
    # `start` made the agentgym-local profile active: a plain `prefect` reaches this server
    view = local_stack.prefect("config", "view").stdout
    assert "agentgym-local" in view and local_stack.api in view


def test_deploy_creates_every_deployment(deployed):
    stack, cfgs, _ = deployed
    with stack.client() as c:
        deps = {f"{c.read_flow(d.flow_id).name}/{d.name}": d for d in c.read_deployments()}
        pool = c.read_work_pool("agentgym-local")
    assert DEPLOYMENTS <= set(deps)
    assert pool.type == "process"
    for name in DEPLOYMENTS:
        d = deps[name]
        assert d.work_pool_name == "agentgym-local" and d.job_variables["working_dir"] == str(ROOT), name
    # the config parameter is the config file's mapping, resolved from its Prefect variable
    assert deps["scaling-inter-rl/quickstart"].parameters == {"config": cfgs["quickstart"], "overrides": []}
    assert deps["retrain/nightly"].parameters["config"] == cfgs["babyai"]
    nightly = deps["retrain/nightly"]
    assert [s.schedule.cron for s in nightly.schedules] == ["0 3 * * *"] and nightly.schedules[0].active
    gcl = nightly.global_concurrency_limit  # prefect.yaml's concurrency_limit: {limit: 1, ...}
    assert gcl is not None and gcl.limit == 1, nightly
    assert nightly.concurrency_options.collision_strategy.value == "ENQUEUE"
    # the UI form: config is a PipelineConfig object, overrides a list of strings
    props = deps["scaling-inter-rl/quickstart"].parameter_openapi_schema["properties"]
    assert props["config"]["$ref"].endswith("PipelineConfig") and props["overrides"]["anyOf"][0]["type"] == "array"


def test_run_with_overrides(deployed, record_property):
    stack, cfgs, tmp = deployed
    t0 = datetime.now(timezone.utc)
    overrides = ["seed=7", "rollout.group_size=3", "schedule.stages=[{horizon: 1, iterations: 1}]"]
    fr_id = stack.run_deployment("scaling-inter-rl/quickstart", f"overrides={json.dumps(overrides)}")
    cli_s = (datetime.now(timezone.utc) - t0).total_seconds()
    run = stack.wait_flow_run(fr_id, timeout=240)
    assert run.state.is_completed(), f"{run.state}\n{stack.log('worker')}"
    first = stack.first_task_start(fr_id, "collect_rollouts")
    timings = {"deployment_run_cli_s": cli_s,
               "run_to_flow_start_s": (run.start_time - t0).total_seconds(),
               "run_to_first_rollout_s": (first - t0).total_seconds(),
               "run_to_completed_s": (run.end_time - t0).total_seconds()}
    stack.timings.update(timings)
    for k, v in timings.items():
        record_property(k, round(v, 1))
    print("MEASURED", json.dumps({k: round(v, 1) for k, v in stack.timings.items()}))
    # the overrides reached the run: MLflow params of the pipeline run, and the episodes written
    q = cfgs["quickstart"]
    client = MlflowClient(q["tracking"]["tracking_uri"])
    exp = client.get_experiment_by_name(q["tracking"]["experiment"])
    pipe = client.search_runs([exp.experiment_id], "tags.`agentgym.kind` = 'pipeline'")
    assert len(pipe) == 1 and pipe[0].info.status == "FINISHED"
    assert pipe[0].data.params["seed"] == "7" and pipe[0].data.params["rollout.group_size"] == "3"
    assert pipe[0].data.params["model.name_or_path"] == "tiny"  # the rest is the deployment's config
    run_id = pipe[0].data.tags["agentgym.run_id"]
    episodes = pd.read_parquet(tmp / "store" / run_id / "episodes")
    assert len(episodes) == 2 * 3 and set(episodes.groupby("group_id").size()) == {3}
    assert (episodes["seed"] == 7).all()
    assert (episodes["horizon"] == 1).all()  # the stages override replaced the rounds schedule
    # one override path: the run's config is what `agentgym train -c <that file> --set ...` builds
    from agentgym.config import load_config
    from agentgym.tracking.tracker import flatten

    want = load_config(stack.configs / "quickstart.yaml", overrides).model_copy(update={"run_id": run_id})
    assert pipe[0].data.params == flatten(want.model_dump(mode="json"))


def test_config_param_replaces_the_whole_config(deployed):
    """Prefect merges run parameters one level deep: a partial `config` is not merged into the
    deployment's (hence `overrides`), and a bad one is refused when the run is created."""
    stack, _, _ = deployed
    out = stack.prefect("deployment", "run", "scaling-inter-rl/quickstart", "--param", 'config={"seed": 3}',
                        "--start-in", "1 day")  # never picked up: it would train the default config
    fr_id = re.search(r"UUID: ([0-9a-f-]{36})", out.stdout).group(1)
    try:
        with stack.client() as c:
            assert c.read_flow_run(fr_id).parameters == {"config": {"seed": 3}, "overrides": []}
    finally:
        with stack.client() as c:
            c.delete_flow_run(fr_id)
    bad = stack.prefect("deployment", "run", "scaling-inter-rl/quickstart", "--param", 'config={"seed": "x"}',
                        check=False)
    assert bad.returncode != 0 and "config.seed" in bad.stdout + bad.stderr
