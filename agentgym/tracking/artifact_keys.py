"""Prefect artifact keys: the one rule every flow and task names its artifacts by."""

from __future__ import annotations

import re
from typing import Any

#: the longest key this project writes (Prefect keys are lower-case letters, digits and dashes)
MAX_KEY_CHARS = 100


def artifact_key(*parts: Any) -> str:
    """A valid Prefect artifact key from ``parts`` (``None`` parts left out): lower-cased, every
    run of other characters one dash, at most ``MAX_KEY_CHARS`` characters."""
    key = re.sub(r"[^a-z0-9-]+", "-", "-".join(str(p) for p in parts if p is not None).lower())
    return re.sub(r"-{2,}", "-", key).strip("-")[:MAX_KEY_CHARS].rstrip("-") or "artifact"


__all__ = ["MAX_KEY_CHARS", "artifact_key"]
