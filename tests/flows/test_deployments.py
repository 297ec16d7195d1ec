"""deployments/local.sh + deployments/prefect.yaml against a real local server and process worker.

What a user types -- `local.sh start`, `local.sh deploy`, `prefect deployment run ... --param` --
with tiny configs in place of configs/*.yaml (AGENTGYM_CONFIG_DIR), then the run is followed to
completion and its parameters are checked where they land (MLflow params, the trajectory store).
"""

import json
import re
import sys
import time
from datetime import datetime, timezone

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from local_stack import ROOT, tiny_config

sys.path.insert(0, str(ROOT / "deployments"))
import sync_variables  # noqa: E402

pytestmark = pytest.mark.slow

# every shipped config has a training deployment (tests/flows/test_prefect_yaml.py); these get
# tiny configs, the smoke deployment its own (configs/tiny-keyword.yaml)
SMOKE = "tiny-keyword"
CONFIG_NAMES = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml") if p.stem != SMOKE)
DEPLOYMENTS = ({f"scaling-inter-rl/{name}" for name in CONFIG_NAMES}
               | {"scaling-inter-rl/smoke", "retrain/nightly", "evaluate-policy/champion"})


def smoke_config(tmp, model_cache) -> dict:
    """configs/tiny-keyword.yaml as shipped, but for where things go: store and MLflow under
    ``tmp``, the tiny model from the test session's cache (built once; nothing is downloaded)."""
    import yaml

    from local_stack import own_artifact_root

    cfg = yaml.safe_load((ROOT / "configs" / f"{SMOKE}.yaml").read_text())
    cfg["model"]["cache_dir"] = model_cache
    cfg["store"]["root"] = str(tmp / "smoke-store")
    cfg["tracking"]["tracking_uri"] = f"sqlite:///{tmp}/smoke-mlflow.db"
    own_artifact_root(cfg["tracking"]["tracking_uri"], cfg["tracking"]["experiment"], tmp / "smoke-mlartifacts")
    return cfg


@pytest.fixture(scope="module")
def deployed(local_stack, model_cache):
    tmp = local_stack.tmp / "deploy-test"
    cfgs = {name: tiny_config(tmp, model_cache, f"deploy-{name}") for name in CONFIG_NAMES}
    # the quickstart deployment's config uses the rounds shorthand: test_run_with_overrides
    # replaces it with schedule.stages through the run's overrides, as `agentgym train --set` does
    cfgs["quickstart"]["schedule"] = {"rounds": [2], "steps_per_stage": 1}
    cfgs[SMOKE] = smoke_config(tmp, model_cache)
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
    # the config parameter is the config file's mapping, resolved from its Prefect variable, with
    # each task-id list as one string (one field of the run form) that parses to the same ids
    from agentgym.config import parse_config

    for name, file in (("scaling-inter-rl/quickstart", "quickstart"), ("retrain/nightly", "babyai"),
                       ("scaling-inter-rl/smoke", SMOKE)):
        config = deps[name].parameters["config"]
        assert config == sync_variables.config_value(stack.configs / f"{file}.yaml"), name
        assert parse_config(config) == parse_config(cfgs[file]), name
    assert deps["scaling-inter-rl/quickstart"].parameters["overrides"] == []
    assert deps["scaling-inter-rl/quickstart"].parameters["config"]["envs"][0]["tasks"] == "0:4"
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


def test_smoke_deployment_runs_in_about_a_minute_and_mlflow_links_its_flow_run(deployed, record_property):
    """`prefect deployment run scaling-inter-rl/smoke` as shipped (configs/tiny-keyword.yaml):
    done within 120 s (asserted below); its flow run is named after the pipeline run id from its
    first log line; its MLflow runs link the flow runs on this configured server, whose pages stay."""
    import httpx
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId, LogFilter

    from agentgym.config import load_config

    stack, cfgs, _ = deployed
    t0 = datetime.now(timezone.utc)
    fr_id = stack.run_deployment("scaling-inter-rl/smoke")
    run = stack.wait_flow_run(fr_id, timeout=300)
    assert run.state.is_completed(), f"{run.state}\n{stack.log('worker')}"
    seconds = (run.end_time - t0).total_seconds()
    stack.timings["smoke_run_to_completed_s"] = seconds
    record_property("smoke_run_to_completed_s", round(seconds, 1))
    print("MEASURED", json.dumps({"smoke_run_to_completed_s": round(seconds, 1),
                                  "smoke_flow_s": round((run.end_time - run.start_time).total_seconds(), 1)}))
    assert seconds < 120, f"the smoke deployment took {seconds:.0f} s"

    smoke = cfgs[SMOKE]
    client = MlflowClient(smoke["tracking"]["tracking_uri"])
    exp = client.get_experiment_by_name(smoke["tracking"]["experiment"])
    pipe = client.search_runs([exp.experiment_id], "tags.`agentgym.kind` = 'pipeline'")
    assert len(pipe) == 1 and pipe[0].info.status == "FINISHED"
    assert pipe[0].data.params["model.name_or_path"] == "tiny"
    want = load_config(ROOT / "configs" / f"{SMOKE}.yaml").stages  # the shipped schedule
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{pipe[0].info.run_id}'")
    assert sorted((c.data.params["stage"], c.data.params["horizon"]) for c in children) == \
        [(str(i), str(s.horizon)) for i, s in enumerate(want)]
    run_id = pipe[0].data.tags["agentgym.run_id"]
    with stack.client() as c:
        assert c.read_flow_run(fr_id).name == run_id
        logs = [log.message for log in c.read_logs(log_filter=LogFilter(flow_run_id={"any_": [fr_id]}))]
        subs = c.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(
            any_=[fr_id])))
    assert f"Beginning flow run {run_id!r} for flow 'scaling-inter-rl'" in logs, logs[:5]
    assert sorted(sorted(r.tags) for r in subs) == sorted(
        sorted(["agentgym", f"run:{run_id}", f"stage:{i}", f"horizon:{s.horizon}"]) for i, s in enumerate(want))
    # links that live: the flow run's page on the configured server, on the run and in its description
    ui = stack.api.removesuffix("/api")
    url = pipe[0].data.tags["agentgym.prefect_flow_run_url"]
    assert url == f"{ui}/runs/flow-run/{fr_id}" and url in pipe[0].data.tags["mlflow.note.content"]
    page = httpx.get(url, headers={"Accept": "text/html"}, follow_redirects=True, timeout=30)  # as a browser asks
    assert page.status_code == 200 and "<html" in page.text.lower(), page.status_code
    stage_runs = {str(r.id) for r in subs}
    for child in children:
        tags = child.data.tags
        assert tags["agentgym.prefect_flow_run_id"] in stage_runs
        assert tags["agentgym.prefect_flow_run_url"] == f"{ui}/runs/flow-run/{tags['agentgym.prefect_flow_run_id']}"


BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def test_run_form_in_a_browser_keeps_the_config(deployed):
    """The deployment's run form in Prefect's default (v2) UI, in headless Chromium: each task-id
    list is one text field, only the None-able sections (trainer.lora, reward.judge) open on "Property is type None", and submitting the
    form unchanged creates a run whose config parses to the deployment's."""
    import shutil

    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.by import By

    from agentgym.config import parse_config

    browser = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        pytest.skip(f"no Chromium (looked for {', '.join(BROWSERS)})")
    stack, _, _ = deployed
    ui = stack.api.removesuffix("/api")
    with stack.client() as c:
        dep = c.read_deployment_by_name("scaling-inter-rl/smoke")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,4000"):
        options.add_argument(arg)
    stack.prefect("work-pool", "pause", "agentgym-local")  # the submitted run must not start
    chromedriver = shutil.which("chromedriver")  # else selenium looks for one online
    service = webdriver.ChromeService(executable_path=chromedriver) if chromedriver else None
    driver = webdriver.Chrome(options=options, service=service)
    created = None
    before: set[str] | None = None  # the deployment's runs before the click; None until read
    try:
        driver.get(f"{ui}/v2/deployments/deployment/{dep.id}/run")
        deadline = time.monotonic() + 90
        while "Submit" not in driver.find_element(By.TAG_NAME, "body").text or "Trainer" not in \
                driver.find_element(By.TAG_NAME, "body").text:
            assert time.monotonic() < deadline, driver.find_element(By.TAG_NAME, "body").text[:2000]
            time.sleep(0.5)
        text = driver.find_element(By.TAG_NAME, "body").text
        assert text.count('Property is type "None"') == 2, text  # trainer.lora (LoRA off), reward.judge (no judge)
        values = [e.get_attribute("value") for e in driver.find_elements(By.CSS_SELECTOR, "input, textarea")]
        assert values.count("0:4") == 1, values  # envs[0].tasks: one text field, not a box per id
        before = {str(r.id) for r in _flow_runs(stack, dep.id)}
        # Under load (two test workers on two cores) a click can land while the form still renders
        # and do nothing: click again after 30 s without a run, three times at most, each with its
        # own wait (the page alone can take most of the 90 s above).
        for _ in range(3):
            next(b for b in driver.find_elements(By.TAG_NAME, "button") if b.text.strip() == "Submit").click()
            clicked = time.monotonic()
            while created is None and time.monotonic() < clicked + 30:
                time.sleep(0.5)
                created = next((r for r in _flow_runs(stack, dep.id) if str(r.id) not in before), None)
            if created is not None:
                break
        assert created is not None, ("submitting the form created no flow run; the page says:\n"
                                     + driver.find_element(By.TAG_NAME, "body").text[:2000])
        assert parse_config(created.parameters["config"]) == parse_config(dep.parameters["config"])
    finally:
        driver.quit()
        if before is not None:  # every run the form made (a later click may have made a second)
            with stack.client() as c:
                for run in _flow_runs(stack, dep.id):
                    if str(run.id) not in before:
                        c.delete_flow_run(run.id)
        stack.prefect("work-pool", "resume", "agentgym-local")


def _flow_runs(stack, deployment_id):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with stack.client() as c:
        return c.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))
