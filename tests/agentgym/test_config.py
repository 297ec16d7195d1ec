from pathlib import Path

import pytest
import yaml

from agentgym.config import ConfigError, PipelineConfig, ScheduleConfig, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_the_documented_curriculum():
    # the README's default ScalingInter-RL horizons (6, 13, 20), not merely "some valid stages"
    assert [s.horizon for s in PipelineConfig().stages] == [6, 13, 20]


def _leaves(node, path=()):
    """(path, value) of every scalar a YAML file sets; lists of mappings are walked by index."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(node, list) and node and all(isinstance(x, dict) for x in node):
        for i, x in enumerate(node):
            yield from _leaves(x, (*path, i))
    else:
        yield path, node


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_shipped_configs_mean_what_they_say(name):
    """Every value a shipped config sets is the value the run gets (no field silently dropped,
    renamed or defaulted on the way)."""
    raw = yaml.safe_load((ROOT / "configs" / name).read_text())
    parsed = load_config(ROOT / "configs" / name).model_dump(mode="json")
    def expand(ids):
        return [t for item in ids for t in (range(*map(int, item.split(":"))) if isinstance(item, str) else [item])]

    for env in raw.get("envs", []):  # 'start:stop:step' task ranges are expanded by design
        for key in ("tasks", "eval_tasks"):
            if key in env:
                env[key] = expand(env[key])
    for stage in (raw.get("schedule") or {}).get("stages") or []:  # and so are a stage's
        for name, ids in (stage.get("tasks") or {}).items():
            stage["tasks"][name] = expand(ids)
    for path, value in _leaves(raw):
        got = parsed
        for p in path:
            got = got[p]
        assert got == value, f"{name}: {'.'.join(map(str, path))} is {got!r}, the file says {value!r}"


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


def test_train_set_replaces_a_rounds_schedule(tmp_path):
    """`agentgym train --set schedule.stages=[...]` on a `rounds:` config (it used to fail with
    "both stages and rounds" while a deployment's overrides accepted it)."""
    p = tmp_path / "c.yaml"
    p.write_text("schedule: {rounds: [6, 13], steps_per_stage: 2}\n")
    cfg = load_config(p, ["schedule.stages=[{horizon: 2, iterations: 3}]"])
    assert [(s.horizon, s.iterations) for s in cfg.stages] == [(2, 3)]
    cfg = load_config(p, ["schedule.rounds=[4]"])  # steps_per_stage stays from the file
    assert [(s.horizon, s.iterations) for s in cfg.stages] == [(4, 2)]


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


def test_task_ranges_expand_and_bad_ranges_say_how_to_fix():
    cfg = parse_config({"envs": [{"name": "babyai", "tasks": ["0:120:40", 7, "1:3"], "eval_tasks": ["4000:4002"]}]})
    assert cfg.envs[0].tasks == [0, 40, 80, 7, 1, 2]
    assert cfg.envs[0].eval_tasks == [4000, 4001]
    with pytest.raises(ConfigError, match=r"envs.0.tasks: .*'0:x' is not 'start:stop' or 'start:stop:step'.*'0:2000:40'"):
        parse_config({"envs": [{"name": "babyai", "tasks": ["0:x"]}]})
    with pytest.raises(ConfigError, match=r"positive step"):
        parse_config({"envs": [{"name": "babyai", "tasks": ["10:0:-1"]}]})
    # a stage's task subset takes the same ranges as envs[].tasks, checked against them after expansion
    stages = lambda sub: {"stages": [{"horizon": 2, "iterations": 1, "tasks": {"babyai": sub}}]}  # noqa: E731
    cfg = parse_config({"envs": [{"name": "babyai", "tasks": ["0:40", "80:280"]}], "schedule": stages([3, "83:280:40"])})
    assert cfg.schedule.stages[0].tasks == {"babyai": [3, 83, 123, 163, 203, 243]}
    with pytest.raises(ConfigError, match=r"schedule.stages.0.tasks.*'1:x' is not 'start:stop'"):
        parse_config({"envs": [{"name": "babyai", "tasks": ["0:40"]}], "schedule": stages(["1:x"])})
    with pytest.raises(ConfigError, match=r"40"):  # seed 1's map is no training task: not in the subset
        parse_config({"envs": [{"name": "babyai", "tasks": ["0:40", "80:280"]}], "schedule": stages(["0:280:40"])})


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


def test_rollout_device_is_for_the_hf_engine_only():
    assert parse_config({"rollout": {"device": "cpu"}}).rollout.device == "cpu"
    with pytest.raises(ConfigError, match="rollout.device=cuda applies to the hf engine only"):
        parse_config({"rollout": {"engine": "vllm", "constrain_actions": False, "device": "cuda"}})


def test_a_cuda_engine_without_a_gpu_is_refused_with_the_fix(monkeypatch):
    import torch

    from agentgym.models.hardware import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    with pytest.raises(RuntimeError, match="set rollout.device: auto or cpu"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"


@pytest.mark.parametrize("old", ["hostfile", "nnodes", "master_addr", "master_port", "driver_port"])
def test_a_removed_multinode_field_names_the_ray_fields(old):
    with pytest.raises(ConfigError) as e:
        parse_config({"trainer": {"world_size": 2, old: 1}})
    msg = str(e.value)
    assert f"trainer.{old}" in msg and "ray.address" in msg and "trainer.world_size" in msg


@pytest.mark.parametrize("address", [None, "local", "auto", "10.1.2.3:6379", "head:6379", "ray://head:10001"])
def test_ray_addresses_that_parse(address):
    assert parse_config({"ray": {"address": address}}).ray.address == address


@pytest.mark.parametrize("address", ["head", "head:port", ":6379"])
def test_a_bad_ray_address_says_what_to_write(address):
    with pytest.raises(ConfigError, match=r"ray.address.*host:port"):
        parse_config({"ray": {"address": address}})


def test_ray_is_used_only_when_asked_for_or_needed():
    assert not parse_config({}).uses_ray  # the quickstart's path: no Ray at all
    assert parse_config({"ray": {"address": "local"}}).uses_ray
    assert parse_config({"rollout": {"workers": 2}}).uses_ray
    assert parse_config({"trainer": {"world_size": 2}}).uses_ray


def test_sampling_seeds_follow_the_worker_count_unless_set():
    assert not parse_config({}).seeds_per_episode  # recorded results keep their sampling
    assert parse_config({"rollout": {"workers": 2}}).seeds_per_episode
    assert parse_config({"rollout": {"sampling_seeds": "per_episode"}}).seeds_per_episode
    assert not parse_config({"rollout": {"workers": 2, "sampling_seeds": "per_call"}}).seeds_per_episode


def test_vllm_server_endpoints_with_ray_workers_are_refused_with_the_alternative():
    with pytest.raises(ConfigError, match=r"rollout workers receive full weights.*rollout.engine: vllm"):
        parse_config({"rollout": {"engine": "vllm_server", "servers": ["http://127.0.0.1:8000"], "workers": 2},
                      "trainer": {"lora": {"r": 8}}})


def test_cuda_ipc_weight_sync_needs_a_gpu_share():
    with pytest.raises(ConfigError, match="ray.gpus_per_worker"):
        parse_config({"ray": {"weight_sync": "cuda_ipc"}})
    assert parse_config({"ray": {"weight_sync": "cuda_ipc", "gpus_per_worker": 0.5}}).ray.gpus_per_worker == 0.5


def test_an_agent_environment_must_name_its_entrypoint():
    from agentgym.config import EnvSpec

    with pytest.raises(ValueError, match="kwargs.entrypoint"):
        EnvSpec(name="agent", tasks=[0])
    assert EnvSpec(name="agent", tasks=[0], kwargs={"entrypoint": "examples.openai_agent:run"}).kwargs


def test_reward_judge_is_refused_with_turn_credit():
    from agentgym.config import PipelineConfig

    judge = {"base_url": "http://127.0.0.1:8000/v1", "model": "judge"}
    PipelineConfig(reward={"judge": judge})  # outcome credit (default): accepted
    with pytest.raises(ValueError, match="algorithm.credit: outcome"):
        PipelineConfig(reward={"judge": judge}, algorithm={"credit": "turn"})
