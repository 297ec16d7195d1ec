"""The names of the held-out results in MLflow (the pipeline run's metrics), in one place.

One series per policy family, at the global step where the policy stopped training, so one chart
shows held-out success across stages: ``heldout/greedy_at_1`` (and ``heldout/avg_at_<k>``,
``heldout/pass_at_<k>``), with ``heldout/random_valid`` at the same steps. Each evaluated policy's
details (per environment and task category, seconds) are ``heldout-by-policy/<label>.<env>.<category>.<name>``
(dots, not slashes: MLflow's UI makes a chart section of every slash-separated prefix, which put ~16
sections before the learning metrics; this way the details are one section, after ``heldout``).
Runs logged before 2026-12-06 have them under ``heldout/<label>/...``; the readers here take both.
"""

from __future__ import annotations

from agentgym.config import StageSpec
from agentgym.schedule import stage_start

RANDOM = "random-valid"  # the label of the random-valid-action baseline
FAMILY = "heldout"
BY_POLICY = "heldout-by-policy"
_LEGACY_BY_POLICY = "heldout"


def detail_key(label: str, name: str) -> str:
    """The MLflow key of detail ``name`` (``overall/greedy_at_1``, ``babyai/goto/greedy_at_1``,
    ``seconds``, ...) of policy ``label``'s held-out result."""
    return f"{BY_POLICY}/{label}.{name.replace('/', '.')}"


def detail_keys(label: str) -> tuple[str, str]:
    """``(today's, the legacy)`` key prefix of ``label``'s details, for readers of either naming."""
    return f"{BY_POLICY}/{label}.", f"{_LEGACY_BY_POLICY}/{label}/"


def policy_metric(metrics: dict[str, float], label: str, name: str) -> float | None:
    """Detail ``name`` of policy ``label``'s held-out result among a run's last ``metrics``
    (either naming); None if absent."""
    for key in (detail_key(label, name), f"{_LEGACY_BY_POLICY}/{label}/{name}"):
        value = metrics.get(key)
        if value is not None:
            return value
    return None


def heldout_step(stages: list[StageSpec], label: str) -> int:
    """The global step at which policy ``label`` stopped training: 0 for the base model, the SFT
    warm start and the random baseline; the RL iterations up to the end of stage k for ``stage-k``."""
    if label.startswith("stage-"):
        return stage_start(stages, int(label.split("-", 1)[1]) + 1)
    return 0
