"""Deployment parameters: ``overrides`` on top of a config (one-level merge workaround)."""

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
