"""The names of the held-out results in MLflow (the pipeline run's metrics), in one place.

One series per policy family, at the global step where the policy stopped training, so one chart
shows held-out success across stages: ``heldout/greedy_at_1`` (and ``heldout/avg_at_<k>``,
``heldout/pass_at_<k>``), with ``heldout/random_valid`` at the same steps. Each evaluated policy's
details (per environment and task category, seconds) are under ``heldout-by-policy/<label>/...``;
runs logged before 2026-12-06 have them under ``heldout/<label>/...``, and the readers here take both.
"""

from __future__ import annotations

from agentgym.config import StageSpec
from agentgym.schedule import stage_start

RANDOM = "random-valid"  # the label of the random-valid-action baseline
FAMILY = "heldout"
BY_POLICY = "heldout-by-policy"
_LEGACY_BY_POLICY = "heldout"


def policy_metric(metrics: dict[str, float], label: str, name: str) -> float | None:
    """Metric ``name`` (``overall/greedy_at_1``, ``overall/avg_at_1``, ``seconds``, ...) of policy
    ``label``'s held-out result among a run's last ``metrics`` (either naming); None if absent."""
    for prefix in (BY_POLICY, _LEGACY_BY_POLICY):
        value = metrics.get(f"{prefix}/{label}/{name}")
        if value is not None:
            return value
    return None


def heldout_step(stages: list[StageSpec], label: str) -> int:
    """The global step at which policy ``label`` stopped training: 0 for the base model, the SFT
    warm start and the random baseline; the RL iterations up to the end of stage k for ``stage-k``."""
    if label.startswith("stage-"):
        return stage_start(stages, int(label.split("-", 1)[1]) + 1)
    return 0
