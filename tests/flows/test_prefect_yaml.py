"""deployments/prefect.yaml, statically: entrypoints, flow names, config variables, schedules."""

import json
import sys
from pathlib import Path

import pytest
import yaml
from prefect.flows import load_flow_from_entrypoint

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deployments"))
import sync_variables  # noqa: E402

SPEC = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
TRAINING = {"quickstart", "babyai", "textcraft", "sciworld", "deepsearch", "textworld_express", "mixed"}
EXPECTED = {f"scaling-inter-rl/{n}" for n in TRAINING} | {"retrain/nightly", "evaluate-policy/champion"}
CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
NOT_DEPLOYED = {"tiny-keyword"}  # the tiny model on the keyword task: a smoke config, not a deployment


@pytest.mark.parametrize("dep", SPEC["deployments"], ids=lambda d: d["name"])
def test_entrypoint_loads_and_parameters_fit_its_signature(dep, monkeypatch):
    monkeypatch.chdir(ROOT)
    fl = load_flow_from_entrypoint(dep["entrypoint"])
    assert f"{fl.name}/{dep['name']}" in EXPECTED
    assert set(dep["parameters"]) <= set(fl.parameters.properties)
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
            and d["parameters"]["config"] == f"{{{{ prefect.variables.agentgym_config_{stem} }}}}"]
    assert [d["name"] for d in deps] == [stem], f"configs/{stem}.yaml needs a scaling-inter-rl/{stem} deployment"


def test_nightly_retrain_is_a_cron_schedule():
    nightly = next(d for d in SPEC["deployments"] if d["name"] == "nightly")
    assert nightly["schedules"] == [{"cron": "0 3 * * *", "timezone": "UTC", "active": True}]
    assert nightly["concurrency_limit"] == {"limit": 1, "collision_strategy": "ENQUEUE"}
