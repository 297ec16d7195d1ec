"""The per-iteration Prefect tasks of the ScalingInter-RL pipeline.

Each returns a small manifest (row counts, digests, metrics), never tensors or DataFrames:
the data itself goes through the trajectory store, so a retried task reads the same input.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from agentgym.config import PipelineConfig
from agentgym.evaluation.heldout_metrics import FAMILY
from agentgym.evaluation.viewer import write_html
from agentgym.infra import progress, tempdirs
from agentgym.pipeline import IterationRef
from agentgym.registry.champion import materialize
from agentgym.registry.policy_model import log_policy_model
from agentgym.store.trajectory_store import TrajectoryStore
from agentgym.tracking.tracker import Tracker
from agentgym.training.protocol import GroupError
from agentgym.training.zero_stage import TRAINER_STATE  # the checkpoint's DeepSpeed state, when kept
from tasks.runtime import drop_session, get_session


@task(name="restore_policy", task_run_name="restore_policy[{run_id}]", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def restore_policy(config: PipelineConfig, run_id: str) -> dict[str, Any]:
    """Load the run's latest checkpoint (if any) into the session; returns where to resume.

    ``start_step`` is the number of iterations the checkpoint had completed: the pipeline
    resumes at that global step, whose stage and horizon the schedule fixes. ``retracted_steps``:
    the global steps whose committed work came from updates after the checkpoint, withdrawn from
    the store so that they are done again (``PolicySession.retract_lost_work``).
    """
    tracker = Tracker.from_config(config.tracking)
    ref = tracker.latest_checkpoint(run_id)
    if ref is None:
        session = get_session(config, run_id, create=True)
        session.store.check_writable()
        # a run killed before its first checkpoint: what its updates sampled is redone too
        return {"start_step": 0, "checkpoint": None, "retracted_steps": session.retract_lost_work(0)}
    # a local folder, or downloaded once into a cache keyed by the artifact URI
    dst = materialize(ref.artifact_uri, config.tracking.tracking_uri, config.model.cache_dir)
    session = get_session(config, run_id, weights=dst, create=True)
    session.policy_version = session.engine_version = int(ref.meta.get("policy_version", ref.global_step))
    if (dst / TRAINER_STATE).is_dir():  # exact resume: optimizer moments, schedule, RNG
        session.trainer.load_checkpoint(dst / TRAINER_STATE)
    retracted = session.retract_lost_work(ref.global_step)
    return {"start_step": ref.global_step, "checkpoint": ref.artifact_uri, "retracted_steps": retracted}


@task(name="collect_rollouts", task_run_name="collect_rollouts[stage {stage} h{horizon} it {iteration}]",
      retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def collect_rollouts(config: PipelineConfig, run_id: str, stage: int, iteration: int,
                     global_step: int, horizon: int) -> dict[str, Any]:
    """Play the iteration's episodes and commit them to the trajectory store (idempotent)."""
    session = get_session(config, run_id)
    return session.collect(
        IterationRef(stage, iteration, global_step), horizon,
        on_turn=lambda turn, live: progress.report("turn", turn=turn, live=live),
    )


@task(name="compute_advantages", task_run_name="compute_advantages[stage {stage} it {iteration}]", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def compute_advantages(config: PipelineConfig, run_id: str, stage: int, iteration: int,
                       global_step: int) -> dict[str, Any]:
    """Read the committed episodes, compute advantages, commit them as their own table."""
    return get_session(config, run_id).advantages(IterationRef(stage, iteration, global_step))


@task(name="update_policy", task_run_name="update_policy[stage {stage} it {iteration}]", cache_policy=NO_CACHE)
def update_policy(config: PipelineConfig, run_id: str, stage: int, iteration: int,
                  global_step: int, sync: bool = True) -> dict[str, Any]:
    """PPO-clip steps on the committed batch, then (``sync``) the weights to the rollout engine.

    No retries: a failed update leaves the optimizer mid-step. When a training rank dies the
    ``GroupError`` names it; the session (and what is left of its group) is dropped, so the
    next attempt, a re-run with the same run id, starts a new group from the latest checkpoint.
    """
    try:
        return get_session(config, run_id).update(IterationRef(stage, iteration, global_step), sync=sync)
    except GroupError:
        drop_session(run_id)
        raise


@task(name="sync_policy", task_run_name="sync_policy[stage {stage} it {iteration}]", cache_policy=NO_CACHE)
def sync_policy(config: PipelineConfig, run_id: str, stage: int, iteration: int,
                global_step: int | None = None) -> dict[str, float]:
    """Hand the trainer's latest weights to the engine if it is behind (rollout.async_steps: the
    flow calls it between rollouts, before starting iteration ``iteration``'s, whose global step
    is ``global_step``; it then waits for an update in progress only when the staleness bound
    needs that update. ``None``: before an evaluation or the next stage, to the latest weights)."""
    return get_session(config, run_id).sync_if_behind(before_step=global_step)


@task(name="save_checkpoint", task_run_name="save_checkpoint[stage {stage} step {global_step}]", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def save_checkpoint(config: PipelineConfig, run_id: str, mlflow_run_id: str, stage: int,
                    global_step: int) -> str:
    """Export the policy as an HF folder and log it to MLflow; returns the artifact URI.

    ``global_step`` is the number of iterations completed, so a resume starts there. With
    ``tracking.checkpoint_trainer_state`` the folder also holds the trainer state, and once it is
    committed the states of older checkpoints beyond ``tracking.trainer_states_kept`` are removed.
    """
    session = get_session(config, run_id)
    tracker = Tracker.from_config(config.tracking)
    commits = [m.to_dict() for m in session.store.commits("episodes")]
    with tempdirs.scratch("agentgym-ckpt-") as tmp:
        session.export(tmp)
        if config.tracking.checkpoint_trainer_state and session.has_trainer:
            session.trainer.save_checkpoint(Path(tmp, TRAINER_STATE), {"global_step": global_step})
        # lineage: the config and every trajectory commit that produced these weights
        Path(tmp, "agentgym_config.json").write_text(json.dumps(config.model_dump(mode="json"), indent=2))
        uri = tracker.log_checkpoint(
            mlflow_run_id, tmp, global_step,
            meta={"run_id": run_id, "stage": stage, "policy_version": session.policy_version,
                  "episode_commits": [{"stage": c["stage"], "iteration": c["iteration"], "digest": c["digest"]}
                                      for c in commits]},
        )
    if config.tracking.checkpoint_trainer_state and config.tracking.trainer_states_kept:
        tracker.prune_checkpoint_subfolder(run_id, TRAINER_STATE, config.tracking.trainer_states_kept)
    return uri


@task(name="log_final_policy", task_run_name="log_final_policy[{run_id}]", retries=1, retry_delay_seconds=2,
      cache_policy=NO_CACHE)
def log_final_policy(config: PipelineConfig, run_id: str, mlflow_run_id: str, checkpoint: str,
                     global_step: int) -> dict[str, Any]:
    """Log the final checkpoint as the pipeline run's MLflow model (pyfunc ``policy``) and, with
    ``tracking.registered_model_name``, register it; once per run (a resume reuses both). The
    model's page shows what trained it (parameters, description) and its held-out success
    (``heldout/...`` at ``global_step``, logged again linked to the model)."""
    tracker = Tracker.from_config(config.tracking)
    folder = materialize(checkpoint, config.tracking.tracking_uri, config.model.cache_dir)
    name = config.tracking.registered_model_name
    stages = " -> ".join(f"h{s.horizon} x {s.iterations}" for s in config.stages)
    envs = ", ".join(sorted({e.name for e in config.envs}))
    logged = log_policy_model(
        tracker.client, tracker.experiment_id, mlflow_run_id, folder, global_step, registered_model_name=name,
        tags={"agentgym.run_id": run_id, "agentgym.checkpoint": checkpoint, "agentgym.global_step": global_step},
        description=(f"Policy trained by ScalingInter-RL run `{run_id}` ({config.algorithm.estimator.value} on "
                     f"{envs}, stages {stages}) from `{config.model.name_or_path}`, after {global_step} "
                     f"iterations. Checkpoint: `{checkpoint}`."),
        params={"run_id": run_id, "base_model": config.model.name_or_path, "envs": envs,
                "estimator": config.algorithm.estimator.value, "stages": stages, "global_step": global_step,
                "group_size": config.rollout.group_size, "learning_rate": config.trainer.learning_rate,
                "sft_warm_start": config.sft.enabled, "seed": config.seed})
    tracker.link_model_metrics(mlflow_run_id, logged.model_id, FAMILY + "/", step=global_step)
    return {"model_id": logged.model_id, "model_uri": logged.model_uri, "registered_model_name": name,
            "version": logged.version}


@task(name="publish_viewer", task_run_name="publish_viewer[{run_id} stage {stage}]", retries=1,
      retry_delay_seconds=2, cache_policy=NO_CACHE)
def publish_viewer(config: PipelineConfig, run_id: str, mlflow_run_id: str, stage: int) -> dict[str, Any]:
    """The run's trajectory viewer (what ``agentgym view`` writes: one offline HTML file) as the
    MLflow artifact ``viewer/<run_id>.html`` of the pipeline run, rewritten after every stage so
    it holds every committed episode so far (newest 5,000 at most); returns its URI and counts."""
    tracker = Tracker.from_config(config.tracking)
    store = TrajectoryStore(config.store.root, run_id, config.store.storage_options)
    with tempfile.TemporaryDirectory(prefix="agentgym-viewer-") as d:
        path = Path(d) / f"{run_id}.html"
        stats = write_html(store, path)
        tracker.log_file(mlflow_run_id, path, "viewer")
    uri = tracker.artifact_uri(mlflow_run_id, f"viewer/{run_id}.html")
    return {"uri": uri, **stats}
