"""What every config model shares: unknown fields rejected, assignments validated, and the JSON
schema shaped for the Prefect UI's run form. In its own module so that a component's config kept
beside its code (``agentgym.rewards.judge_config``) and ``agentgym.config`` use the same base."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


def _form_schema(schema: dict[str, Any]) -> None:
    """The JSON schema of a config model as the Prefect UI's run form wants it (the form is
    rendered from it; parsing never reads it). A field that may be None and defaults to None
    loses its ``default: null``: with it the form opens such a field on its None choice ("Property
    is type 'None'"); without it the field opens on its value's input, empty, and an empty input
    is left out of the run's parameters, so the config's default (None) applies. A None-able
    section (trainer.lora) keeps it: the form would fill an empty section with its defaults and
    so switch it on. A mapping (schedule.stages[].tasks) has no defaults to fill, so it opens
    empty like a value."""
    for prop in schema.get("properties", {}).values():
        branches = prop.get("anyOf", [])
        if {"type": "null"} not in branches or "default" not in prop or prop["default"] is not None:
            continue
        if not any("$ref" in b or "properties" in b for b in branches):
            del prop["default"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, json_schema_extra=_form_schema)

