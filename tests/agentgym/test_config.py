from pathlib import Path

import pytest

from agentgym.config import ConfigError, PipelineConfig, ScheduleConfig, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_valid():
    cfg = PipelineConfig()
    assert [s.horizon for s in cfg.stages] == [6, 13, 20]


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_shipped_configs_load(name):
    cfg = load_config(ROOT / "configs" / name)
    assert len(cfg.stages) >= 1


def test_rounds_shorthand_expands():
    s = ScheduleConfig(rounds=[6, 13, 20], steps_per_stage=4)
    assert [(x.horizon, x.iterations) for x in s.resolved()] == [(6, 4), (13, 4), (20, 4)]


def test_rounds_without_steps_says_how_to_fix():
    with pytest.raises(ConfigError, match="steps_per_stage"):
        parse_config({"schedule": {"rounds": [6, 13]}})


def test_unknown_field_is_named():
    with pytest.raises(ConfigError) as e:
        parse_config({"rollout": {"group_sise": 4}})
    assert "rollout.group_sise" in str(e.value) and "unknown field" in str(e.value)


def test_invalid_value_is_named():
    with pytest.raises(ConfigError, match="rollout.temperature"):
        parse_config({"rollout": {"temperature": 0}})


def test_grpo_needs_groups():
    with pytest.raises(ConfigError, match="group_size >= 2"):
        parse_config({"rollout": {"group_size": 1}})


def test_gae_without_critic_fails_with_fix():
    with pytest.raises(ConfigError, match="critic"):
        parse_config({"algorithm": {"estimator": "gae"}})


def test_overrides_apply(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("schedule: {stages: [{horizon: 2, iterations: 1}]}\n")
    cfg = load_config(p, ["rollout.group_size=8", "envs=[{name: textcraft, tasks: [1]}]"])
    assert cfg.rollout.group_size == 8 and cfg.envs[0].name == "textcraft"


def test_missing_file_is_clear(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="it is a directory"):
        load_config(tmp_path)


def test_yaml_syntax_errors_are_config_errors_with_the_position(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("seed: 0\nrollout: {group_size: 2\n")
    with pytest.raises(ConfigError, match=r"c.yaml is not valid YAML.*line 3, column 1"):
        load_config(p)
    p.write_text("seed: 0\n")
    with pytest.raises(ConfigError, match=r"override 'rollout.group_size=\[1,': the value is not valid YAML"):
        load_config(p, ["rollout.group_size=[1,"])
    with pytest.raises(ConfigError, match="not valid YAML"):
        from agentgym.config import with_overrides

        with_overrides(PipelineConfig(), ["envs=[{name: babyai"])


def test_env_names_and_task_ids_are_checked_before_a_run():
    with pytest.raises(ConfigError, match=r"envs.0.name: .*unknown environment 'nosuchenv'; choose one of .*babyai"):
        parse_config({"envs": [{"name": "nosuchenv", "tasks": [0]}]})
    with pytest.raises(ConfigError, match=r"envs.0.tasks: .*0 or more; got \[-1\]"):
        parse_config({"envs": [{"name": "textcraft", "tasks": [3, -1]}]})
    with pytest.raises(ConfigError, match=r"envs.0.eval_tasks"):
        parse_config({"envs": [{"name": "textcraft", "tasks": [3], "eval_tasks": [-2]}]})


def test_an_adapter_can_be_named_by_its_import_path():
    from env_adapters import make_env

    cfg = parse_config({"envs": [{"name": "env_adapters.keyword:KeywordEnv", "tasks": [0],
                                  "kwargs": {"target": "yes"}}]})
    env = make_env(cfg.envs[0].name, **cfg.envs[0].kwargs)
    assert type(env).__name__ == "KeywordEnv" and env.reset(0)[0]


def test_configuration_reference_is_current():
    from agentgym.config_docs import config_markdown

    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == config_markdown(), "run: agentgym config docs > docs/configuration.md"


def test_every_field_has_a_description():
    from pydantic import BaseModel

    def walk(model):
        for name, f in model.model_fields.items():
            assert f.description, f"{model.__name__}.{name} has no description"
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann)

    walk(PipelineConfig)
