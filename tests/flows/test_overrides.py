"""One override path: the same `--set` list gives the same config through `agentgym train`, a
deployment's `overrides` parameter (the flow's own parameter handling) and `agentgym eval`,
including replacing a `rounds:` schedule with `schedule.stages=[...]`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from agentgym.config import ConfigError, PipelineConfig, load_config
from agentgym_cli.cli import app

ROOT = Path(__file__).resolve().parents[2]

FILE = {"model": {"name_or_path": "tiny"},
        "envs": [{"name": "keyword", "tasks": [0, 1], "eval_tasks": [9], "kwargs": {"target": "yes"}},
                 {"name": "babyai", "tasks": [3]}],
        "schedule": {"rounds": [2, 4], "steps_per_stage": 1}}

CASES = {
    "stages over rounds": ["schedule.stages=[{horizon: 1, iterations: 2}, {horizon: 3, iterations: 1}]"],
    "list index and nested": ["envs.0.eval_tasks=[5, 6]", "envs.1.kwargs.x=1", "rollout.group_size=3"],
    "rounds over rounds": ["schedule.rounds=[5]", "seed=4"],
}


class _Captured(Exception):
    """Raised by the fakes below once they hold the config the command or flow built."""


def _write(tmp_path: Path) -> Path:
    path = tmp_path / "rounds.yaml"
    path.write_text(yaml.safe_dump(FILE))
    return path


def _plain(cfg: PipelineConfig | dict) -> dict:
    data = cfg.model_dump(mode="json") if isinstance(cfg, PipelineConfig) else dict(cfg)
    data.pop("run_id", None)
    return data


def via_train(path: Path, overrides: list[str], monkeypatch) -> dict:
    import flows.train

    seen = {}

    def fake_flow(cfg):
        seen["cfg"] = cfg
        return {"run_id": cfg.run_id, "mlflow_run_id": "-", "tracking_uri": "-", "experiment": "-",
                "store": "-", "resumed_from_step": 0, "stages": []}

    with monkeypatch.context() as mp:
        mp.setattr(flows.train, "scaling_inter_rl", fake_flow)
        out = CliRunner().invoke(app, ["train", "-c", str(path), *[a for o in overrides for a in ("--set", o)]])
    assert out.exit_code == 0, out.output
    return _plain(seen["cfg"])


def via_deployment(path: Path, overrides: list[str], monkeypatch) -> dict:
    """What `prefect deployment run scaling-inter-rl/NAME --param overrides=[...]` does: the
    deployment's `config` is the file's YAML as JSON (deployments/sync_variables.py), Prefect
    validates the parameters against the flow's signature, and the flow applies `overrides`."""
    import flows.train

    spec = importlib.util.spec_from_file_location("sync_variables", ROOT / "deployments/sync_variables.py")
    sync = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sync)
    params = flows.train.scaling_inter_rl.validate_parameters(
        {"config": sync.config_value(path), "overrides": list(overrides)})

    class FakeTracker:  # the flow's first use of the resolved config: stop there
        def __init__(self, *a, **k):
            pass

        @classmethod
        def from_config(cls, tracking):
            return cls()

        def pipeline_run(self, run_id, config_dump):
            raise _Captured(config_dump)

    with monkeypatch.context() as mp, pytest.raises(_Captured) as got:
        mp.setattr(flows.train, "Tracker", FakeTracker)
        flows.train.scaling_inter_rl.fn(**params)
    return _plain(got.value.args[0])


def via_eval(path: Path, overrides: list[str], monkeypatch) -> dict:
    import flows.evaluate

    def fake_evaluate(cfg, **kw):
        raise _Captured(cfg)

    with monkeypatch.context() as mp:
        mp.setattr(flows.evaluate, "evaluate_policy", fake_evaluate)
        out = CliRunner().invoke(app, ["eval", "run", "tiny", "-c", str(path),
                                       *[a for o in overrides for a in ("--set", o)]])
    assert isinstance(out.exception, _Captured), out.output
    return _plain(out.exception.args[0])


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_overrides_same_config_everywhere(case, tmp_path, monkeypatch):
    path, overrides = _write(tmp_path), CASES[case]
    want = _plain(load_config(path, overrides))
    assert via_train(path, overrides, monkeypatch) == want
    assert via_deployment(path, overrides, monkeypatch) == want
    assert via_eval(path, overrides, monkeypatch) == want


def test_stages_override_replaces_a_rounds_schedule(tmp_path, monkeypatch):
    path = _write(tmp_path)
    cfg = load_config(path, CASES["stages over rounds"])
    assert [(s.horizon, s.iterations) for s in cfg.stages] == [(1, 2), (3, 1)]
    assert cfg.schedule.rounds is None and cfg.schedule.steps_per_stage is None
    out = CliRunner().invoke(app, ["config", "check", str(path), "--set", CASES["stages over rounds"][0]])
    assert out.exit_code == 0 and "stage 0: horizon 1 x 2, stage 1: horizon 3 x 1" in out.output, out.output
    # a file that itself names both forms is still refused: only an override replaces one
    both = tmp_path / "both.yaml"
    both.write_text(yaml.safe_dump({**FILE, "schedule": {**FILE["schedule"], "stages": [{"horizon": 1, "iterations": 1}]}}))
    with pytest.raises(ConfigError, match="both stages and rounds"):
        load_config(both)
