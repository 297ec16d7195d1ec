"""The per-iteration Prefect tasks of the ScalingInter-RL pipeline.

Each returns a small manifest (row counts, digests, metrics), never tensors or DataFrames:
the data itself goes through the trajectory store, so a retried task reads the same input.
"""

from __future__ import annotations

import tempfile
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from agentgym import progress
from agentgym.config import PipelineConfig
from agentgym.pipeline import IterationRef
from agentgym.tracking import Tracker
from tasks.runtime import get_session


@task(name="collect_rollouts", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def collect_rollouts(config: PipelineConfig, run_id: str, stage: int, iteration: int,
                     global_step: int, horizon: int) -> dict[str, Any]:
    """Play the iteration's episodes and commit them to the trajectory store (idempotent)."""
    session = get_session(config, run_id)
    return session.collect(
        IterationRef(stage, iteration, global_step), horizon,
        on_turn=lambda turn, live: progress.report("turn", turn=turn, live=live),
    )


@task(name="compute_advantages", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def compute_advantages(config: PipelineConfig, run_id: str, stage: int, iteration: int,
                       global_step: int) -> dict[str, Any]:
    """Read the committed episodes, compute advantages, commit them as their own table."""
    return get_session(config, run_id).advantages(IterationRef(stage, iteration, global_step))


@task(name="update_policy", cache_policy=NO_CACHE)
def update_policy(config: PipelineConfig, run_id: str, stage: int, iteration: int,
                  global_step: int) -> dict[str, Any]:
    """PPO-clip steps on the committed batch, then sync the weights to the rollout engine."""
    return get_session(config, run_id).update(IterationRef(stage, iteration, global_step))


@task(name="save_checkpoint", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def save_checkpoint(config: PipelineConfig, run_id: str, mlflow_run_id: str, stage: int,
                    global_step: int) -> str:
    """Export the policy as an HF folder and log it to MLflow; returns the artifact URI.

    ``global_step`` is the number of iterations completed, so a resume starts there.
    """
    session = get_session(config, run_id)
    tracker = Tracker(config.tracking.tracking_uri, config.tracking.experiment)
    commits = [m.to_dict() for m in session.store.commits("episodes")]
    with tempfile.TemporaryDirectory(prefix="agentgym-ckpt-") as tmp:
        session.export(tmp)
        return tracker.log_checkpoint(
            mlflow_run_id, tmp, global_step,
            meta={"run_id": run_id, "stage": stage, "policy_version": session.policy_version,
                  "episode_commits": [c["digest"] for c in commits]},
        )
