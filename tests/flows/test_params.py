"""Deployment parameters: ``overrides`` on top of a config (one-level merge workaround), and the
config's JSON schema as Prefect's run form and parameter validation use it."""

import re

import pytest

from agentgym.config import ConfigError, parse_config
from agentgym.config import with_overrides

BASE = {"model": {"name_or_path": "tiny"},
        "envs": [{"name": "keyword", "tasks": [0, 1], "kwargs": {"target": "yes"}},
                 {"name": "babyai", "tasks": [3]}],
        "schedule": {"rounds": [2, 4], "steps_per_stage": 1}}


def test_overrides_change_only_the_named_fields():
    cfg = parse_config(BASE)
    out = with_overrides(cfg, ["seed=7", "rollout.group_size=3", "envs.1.eval_tasks=[40, 41]",
                               "envs.0.kwargs.mode=char_share", "trainer.lora.r=4"])
    assert out.seed == 7 and out.rollout.group_size == 3 and out.envs[1].eval_tasks == [40, 41]
    assert out.envs[0].kwargs == {"target": "yes", "mode": "char_share"} and out.trainer.lora.r == 4
    assert out.model.name_or_path == "tiny" and out.envs[0].tasks == [0, 1]
    assert with_overrides(cfg, []) is cfg and with_overrides(cfg, None) is cfg


def test_one_override_replaces_the_schedule_form():
    cfg = parse_config(BASE)
    out = with_overrides(cfg, ["schedule.stages=[{horizon: 1, iterations: 2}]"])
    assert [(s.horizon, s.iterations) for s in out.stages] == [(1, 2)]
    back = with_overrides(out, ["schedule.rounds=[3, 5]", "schedule.steps_per_stage=2"])
    assert [(s.horizon, s.iterations) for s in back.stages] == [(3, 2), (5, 2)]


@pytest.mark.parametrize("bad, match", [
    ("seed", "field.path=value"),
    ("envs.x.tasks=[1]", "is a list; index it with a number"),
    ("envs.5.tasks=[1]", "has 2 item"),
    ("seed.x=1", "is not a section"),
    ("rollout.group_sise=4", "rollout.group_sise: unknown field"),
    ("rollout.temperature=0", "rollout.temperature"),
])
def test_bad_overrides_say_what_is_wrong(bad, match):
    with pytest.raises(ConfigError, match=match):
        with_overrides(parse_config(BASE), [bad])


def _descriptions(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "description" and isinstance(v, str):
                yield v
            else:
                yield from _descriptions(v)
    elif isinstance(node, list):
        for v in node:
            yield from _descriptions(v)


def test_the_prefect_form_describes_every_parameter_in_plain_text():
    """The Prefect UI renders descriptions as markdown/HTML: ``<env>`` would vanish as a tag."""
    import re

    from prefect.utilities.callables import parameter_schema

    from flows.train import scaling_inter_rl

    schema = parameter_schema(scaling_inter_rl).model_dump()
    props = schema["properties"]
    assert "docs/configuration.md" in props["config"]["description"]
    assert "field.path=value" in props["overrides"]["description"]
    texts = list(_descriptions(schema))
    assert any("eval/ENV/CATEGORY/avg_at_K" in t for t in texts)  # tracking.eval_every, in the form
    tags = [(t, m) for t in texts for m in re.findall(r"<[A-Za-z/][^>]*>", t)]
    assert not tags, tags


def _form_schema():
    from prefect.utilities.callables import parameter_schema

    from flows.train import scaling_inter_rl

    return parameter_schema(scaling_inter_rl).model_dump()


def _none_able(schema):
    """(model, field) -> property schema, for every config field that may be None."""
    return {(model, field): prop for model, d in schema["definitions"].items()
            for field, prop in d.get("properties", {}).items() if {"type": "null"} in prop.get("anyOf", [])}


def test_the_run_form_opens_a_none_field_on_its_own_input():
    """A None-able field with ``default: null`` opens on its None choice, "Property is type 'None'"
    (what the UI showed for ~20 fields). Without the default it opens on its input, empty, and an
    empty input is left out of the run (the config's default applies). Only trainer.lora keeps it:
    an empty LoRA section would be filled with defaults, switching LoRA on."""
    none_able = _none_able(_form_schema())
    assert len(none_able) >= 19, sorted(none_able)
    opens_on_none = sorted(k for k, p in none_able.items() if "default" in p and p["default"] is None)
    assert opens_on_none == [("RewardConfig", "judge"), ("TrainerConfig", "lora")]
    vague = [k for k, p in none_able.items() if not re.search(r"\bNone\b|\bnull\b", p.get("description", ""))]
    assert not vague, f"say what None means: {vague}"


def test_a_task_list_is_one_text_field_in_the_run_form():
    from agentgym.config import EnvSpec

    props = _form_schema()["definitions"]["EnvSpec"]["properties"]
    for field, default in (("tasks", list(range(8))), ("eval_tasks", [])):
        prop = props[field]
        assert "type" not in prop and "items" not in prop  # no top-level array: no box per id
        text, listed = prop["anyOf"]
        assert text["type"] == "string" and listed["type"] == "array"
        assert getattr(EnvSpec(**{"tasks": [0], field: prop["default"]}), field) == default
    # the string form parses to the ids, in order, that the list form gives
    for text, ids in (("0:3, 8, 40:43", [0, 1, 2, 8, 40, 41, 42]), ("[7, '0:120:40']", [7, 0, 40, 80]),
                      ("5", [5])):
        assert parse_config({"envs": [{"name": "babyai", "tasks": text}]}).envs[0].tasks == ids
    with pytest.raises(ConfigError, match="envs.0.tasks"):
        parse_config({"envs": [{"name": "babyai", "tasks": "1, x"}]})


@pytest.mark.parametrize("ids", [[0, 1, 2, 4, 8, 9, 10, 40, 41, 42], [5, 4, 3, 3, 7], [], [2], ["0:120:40", 1, 2, 3]])
def test_compact_task_ids_reads_back_to_the_same_ids(ids):
    from agentgym.config import compact_task_ids, parse_task_ids

    text = compact_task_ids(ids)
    assert len(text) <= len(str(ids))  # never longer than the list
    expand = lambda items: parse_config({"envs": [{"name": "babyai", "tasks": [0] + items}]}).envs[0].tasks[1:]  # noqa: E731
    assert expand(parse_task_ids(text)) == expand(list(ids))


def test_prefect_accepts_every_config_form_where_it_validates_parameters():
    """Prefect checks a deployment's parameters against the schema when the deployment is made
    (plain JSON schema) and when a run is created (its preprocessed form): task lists as strings
    or lists, and explicit nulls, pass both; a wrong type still fails."""
    from prefect._internal.schemas.validators import validate_values_conform_to_schema
    from prefect.utilities.schema_tools import validate

    schema = _form_schema()
    good = [{"envs": [{"name": "babyai", "tasks": "0:40, 80", "eval_tasks": [40, "41:45"]}]},
            {"envs": [{"name": "babyai", "tasks": [0, 1]}], "heldout": {"horizon": None}, "run_id": None,
             "trainer": {"lora": None, "train_layers": None}, "schedule": {"stages": None, "rounds": [2],
                                                                          "steps_per_stage": 1}}]
    for config in good:
        validate_values_conform_to_schema({"config": config}, schema, ignore_required=True)
        assert validate({"config": config}, schema, ignore_required=True) == []
        parse_config(config)
    with pytest.raises(ValueError, match="heldout"):
        validate_values_conform_to_schema({"config": {"heldout": {"horizon": "x"}}}, schema, ignore_required=True)
    with pytest.raises(ValueError, match="tasks"):
        validate_values_conform_to_schema({"config": {"envs": [{"tasks": 3}]}}, schema, ignore_required=True)
