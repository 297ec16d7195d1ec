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
EXPECTED = {"scaling-inter-rl/quickstart", "scaling-inter-rl/babyai", "scaling-inter-rl/textcraft",
            "retrain/nightly", "evaluate-policy/champion"}


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
    assert set(wanted.values()) == {"quickstart", "babyai", "textcraft"}
    for stem in wanted.values():
        value = sync_variables.config_value(ROOT / "configs" / f"{stem}.yaml")  # validates
        assert len(json.dumps(value)) < sync_variables.MAX_CHARS
        assert any(e.get("eval_tasks") for e in value["envs"]), f"{stem}: evaluation needs eval_tasks"


def test_nightly_retrain_is_a_cron_schedule():
    nightly = next(d for d in SPEC["deployments"] if d["name"] == "nightly")
    assert nightly["schedules"] == [{"cron": "0 3 * * *", "timezone": "UTC", "active": True}]
    assert nightly["concurrency_limit"] == {"limit": 1, "collision_strategy": "ENQUEUE"}
