"""Render the configuration reference (docs/configuration.md) from the pydantic models.

The models are the single source of truth: a test fails when the committed reference and the
models disagree; `agentgym config docs > docs/configuration.md` regenerates it.
"""

from __future__ import annotations

import json
import typing

from pydantic import BaseModel

from agentgym.config import EnvSpec, PipelineConfig, StageSpec


def _default(field) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    if hasattr(value, "value"):
        value = value.value
    try:
        return f"`{json.dumps(value, default=lambda o: o.model_dump(mode='json'))}`"
    except TypeError:
        return f"`{value}`"


def _section(model: type[BaseModel], prefix: str, out: list[str]) -> None:
    nested: list[tuple[str, type[BaseModel]]] = []
    out.append(f"\n## `{prefix or 'top level'}`\n")
    if model.__doc__ and model is not PipelineConfig:
        out.append(" ".join(model.__doc__.split()) + "\n")
    out.append("| field | default | description |\n|---|---|---|")
    for name, field in model.model_fields.items():
        # a section, or an optional one (``X | None``: trainer.lora, reward.judge) listed the same way
        for ann in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                nested.append((name, ann))
                break
        desc = (field.description or "").replace("|", "\\|")
        out.append(f"| `{name}` | {_default(field)} | {desc} |")
    for name, sub in nested:
        _section(sub, f"{prefix}.{name}" if prefix else name, out)


def config_markdown() -> str:
    out = ["# Configuration reference", "",
           "Generated from `agentgym/config.py` by `agentgym config docs`; do not edit by hand.",
           "A YAML file (see `configs/`) or a Prefect parameter holds these fields; unknown fields",
           "are rejected with the field's name."]
    _section(PipelineConfig, "", out)
    _section(EnvSpec, "envs[]", out)
    _section(StageSpec, "schedule.stages[]", out)
    return "\n".join(out) + "\n"
