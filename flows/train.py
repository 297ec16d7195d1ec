"""The ScalingInter-RL pipeline: one Prefect subflow per stage, in order of growing horizon.

    scaling-inter-rl(config)
      └─ stage(index=0, horizon=h0, iterations=n0)
           └─ per iteration: collect_rollouts → compute_advantages → update_policy
           └─ save_checkpoint (every k steps and at the end of the stage)
      └─ stage(index=1, horizon=h1, ...)
      ...

The stage of a global step is ``agentgym.schedule.position(stages, step)``: a pure function,
so a resumed run is in the same stage, at the same horizon, as an uninterrupted one.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Any

import numpy as np
from prefect import flow, get_run_logger

from agentgym import progress
from agentgym.config import PipelineConfig
from agentgym.schedule import position, stage_start, total_steps
from agentgym.tracking import Tracker
from tasks.rl import collect_rollouts, compute_advantages, save_checkpoint, update_policy
from tasks.runtime import drop_session

ITERATION_METRICS = (
    "reward_mean", "success_rate", "turns_per_episode", "format_error_rate", "gen_tokens_per_s",
    "rollout_seconds", "infra_error_episodes", "tied_groups", "adv_mean", "adv_std",
    "policy_loss", "kl", "entropy", "clipfrac", "clipfrac_low", "clipfrac_high", "approx_kl",
    "grad_norm", "update_seconds", "optimizer_steps", "skipped_episodes",
)


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


@flow(name="stage", flow_run_name="stage-{index}-horizon-{horizon}", log_prints=True)
def stage_flow(config: PipelineConfig, run_id: str, parent_mlflow_id: str, index: int,
               horizon: int, iterations: int) -> dict[str, Any]:
    """Run one ScalingInter-RL stage: ``iterations`` RL iterations capped at ``horizon`` turns."""
    logger = get_run_logger()
    tracker = Tracker(config.tracking.tracking_uri, config.tracking.experiment)
    child = tracker.stage_run(parent_mlflow_id, run_id, index, horizon, iterations)
    start = stage_start(config.stages, index)
    every = config.tracking.checkpoint_every
    history: list[dict[str, Any]] = []
    for it in range(iterations):
        gs = start + it
        pos = position(config.stages, gs)
        assert (pos.stage, pos.horizon, pos.iteration) == (index, horizon, it), pos
        rollout = collect_rollouts(config, run_id, index, it, gs, horizon)
        adv = compute_advantages(config, run_id, index, it, gs)
        upd = update_policy(config, run_id, index, it, gs)
        metrics = {k: v for part in (rollout, adv, upd) for k, v in part.items() if k in ITERATION_METRICS}
        metrics["horizon"] = horizon
        tracker.log_metrics(child, metrics, step=gs)
        tracker.log_metrics(parent_mlflow_id, metrics, step=gs)
        history.append(metrics)
        logger.info("stage %d iter %d (step %d, horizon %d): reward %.3f success %.2f",
                    index, it, gs, horizon, metrics["reward_mean"], metrics["success_rate"])
        progress.report("iteration", stage=index, horizon=horizon, global_step=gs, metrics=metrics)
        if every and (gs + 1) % every == 0 and it != iterations - 1:
            save_checkpoint(config, run_id, child, index, gs + 1)
    checkpoint = save_checkpoint(config, run_id, child, index, start + iterations)
    tracker.finish_stage(child)
    return {
        "stage": index, "horizon": horizon, "iterations": iterations, "mlflow_run_id": child,
        "checkpoint": checkpoint,
        "success_rate": float(np.nanmean([m["success_rate"] for m in history])),
        "reward_mean": float(np.nanmean([m["reward_mean"] for m in history])),
        "final_success_rate": history[-1]["success_rate"],
    }


@flow(name="scaling-inter-rl", log_prints=True)
def scaling_inter_rl(config: PipelineConfig = PipelineConfig()) -> dict[str, Any]:  # noqa: B008
    """Train an agent with the ScalingInter-RL curriculum described by ``config.schedule``."""
    run_id = config.run_id or new_run_id()
    config = config.model_copy(update={"run_id": run_id})
    tracker = Tracker(config.tracking.tracking_uri, config.tracking.experiment)
    parent = tracker.pipeline_run(run_id, config.model_dump(mode="json"))
    progress.report("start", total=total_steps(config.stages), run_id=run_id)
    stages: list[dict[str, Any]] = []
    try:
        for index, spec in enumerate(config.stages):
            stages.append(stage_flow(config, run_id, parent, index, spec.horizon, spec.iterations))
        tracker.finish_pipeline(parent)
    except BaseException:
        tracker.finish_pipeline(parent, "FAILED")
        raise
    finally:
        drop_session(run_id)
    return {
        "run_id": run_id, "mlflow_run_id": parent, "tracking_uri": config.tracking.tracking_uri,
        "experiment": config.tracking.experiment, "store": f"{config.store.root.rstrip('/')}/{run_id}",
        "stages": stages,
    }
