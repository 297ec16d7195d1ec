"""The ScalingInter-RL pipeline: one Prefect subflow per stage, in order of growing horizon.

    scaling-inter-rl(config)
      └─ stage(index=0, horizon=h0, iterations=n0)
           └─ per iteration: collect_rollouts → compute_advantages → update_policy
           └─ save_checkpoint (every k steps and at the end of the stage)
      └─ stage(index=1, horizon=h1, ...)
      ...

The stage of a global step is ``agentgym.schedule.position(stages, step)``: a pure function,
so a resumed run is in the same stage, at the same horizon, as an uninterrupted one.

With ``schedule.max_env_steps`` the run ends after the iteration that spends the budget (the
environment steps played so far are read back from MLflow, so a resumed run counts its earlier
attempts'); that stage's checkpoint is the final policy and is evaluated held out.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
from prefect import flow, get_run_logger, tags
from prefect.futures import PrefectFuture

from agentgym.config import PipelineConfig, with_overrides
from agentgym.infra import progress
from agentgym.schedule import position, stage_start, total_steps
from agentgym.store.trajectory_store import TrajectoryStore
from agentgym.tracking.artifact_keys import artifact_key
from agentgym.tracking.run_summary import pipeline_description, stage_description, summary_markdown
from agentgym.tracking.tracker import Tracker
from tasks.links import (TAG_FLOW_RUN_URL, link_mlflow_run, name_flow_run, pipeline_run_id, pipeline_run_name,
                         prefect_tags)
from tasks.rl import (collect_rollouts, compute_advantages, log_final_policy, publish_viewer, restore_policy,
                      save_checkpoint, sync_policy, update_policy)
from tasks.evaluation import EvalSettings, EvalSink, evaluate_live_run
from tasks.heldout import heldout_policy, heldout_random_valid, publish_comparison, publish_learning_curve
from tasks.runtime import drop_session
from flows.sft import sft_flow
from flows.tagging import untagged_tasks

# What a step's manifest holds besides its metrics: where its data went, not a measurement.
MANIFEST_KEYS = frozenset({"rows", "digest", "reused", "updated"})


def iteration_metrics(*manifests: dict[str, Any]) -> dict[str, float]:
    """Every number the iteration's steps returned, under the step's own name (no allow-list: a
    metric a step adds reaches MLflow without an edit here). Each quantity has one name; a name
    two steps share (``kl``: in the rewards or in the loss, never both) is the later step's."""
    return {k: float(v) for m in manifests for k, v in m.items()
            if k not in MANIFEST_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool)}


def run_tags(run_id: str) -> tuple[str, ...]:
    """Prefect tags of a pipeline run's subflow runs (not their task runs: ``flows.tagging``):
    filter the runs of one pipeline run by ``run:<id>``, a stage by ``stage:<i>``, a horizon by
    ``horizon:<h>``."""
    return ("agentgym", f"run:{run_id}")


STAGE_TABLE_METRICS = ("reward_mean", "success_rate", "turns_per_episode", "format_error_rate")
# MLflow's UI draws a run's charts in sections by name prefix, alphabetically, with the names
# without a prefix ("Model metrics") last: these series are also logged as ``learning/<name>`` so
# a stage run opens on them, ahead of the ``time/`` section (scripts read the plain names).
HEADLINE_PREFIX = "learning/"


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics``' ``STAGE_TABLE_METRICS`` again under ``HEADLINE_PREFIX``."""
    return {HEADLINE_PREFIX + k: metrics[k] for k in STAGE_TABLE_METRICS if k in metrics}


def env_steps_played(tracker: Tracker, parent_mlflow_id: str, before: int) -> float:
    """Environment steps the run's training rollouts played at global steps below ``before``
    (the pipeline run's ``env_steps`` per iteration; a redone step counts once)."""
    return float(sum(v for step, v in tracker.metric_steps(parent_mlflow_id, "env_steps") if step < before))


def budget_spent(config: PipelineConfig, env_steps: float) -> bool:
    """Whether ``env_steps`` played spend ``schedule.max_env_steps`` (never, without one)."""
    budget = config.schedule.max_env_steps
    return budget is not None and env_steps >= budget


def _budget_summary(config: PipelineConfig, iterations_done: int, end_step: int, env_steps: float) -> dict[str, Any]:
    """A stage summary's budget fields: iterations it ran, the global step it ended at, the run's
    environment steps by then, and whether they spent ``schedule.max_env_steps``."""
    return {"iterations_done": iterations_done, "end_step": end_step, "env_steps": env_steps,
            "budget_spent": budget_spent(config, env_steps)}


def _stage_history(tracker: Tracker, child: str) -> list[dict[str, Any]]:
    """The stage run's ``STAGE_TABLE_METRICS`` per global step, read back from MLflow: after a
    resume it holds every attempt's iterations, not only the last one's."""
    by_step: dict[int, dict[str, Any]] = {}
    for key in STAGE_TABLE_METRICS:
        for step, value in tracker.metric_steps(child, key):
            by_step.setdefault(step, {"global_step": step})[key] = value
    return [by_step[step] for step in sorted(by_step)]


def _stage_artifact(tracker: Tracker, run_id: str, index: int, horizon: int, child: str,
                    history: list[dict[str, Any]], viewer: str | None = None) -> None:
    """The stage's per-iteration table as a Prefect artifact, linking its MLflow run and the
    run's trajectory viewer."""
    from prefect.artifacts import create_table_artifact

    create_table_artifact(
        key=artifact_key("stage", index, run_id),
        table=[{k: v if k == "global_step" else round(v, 4) for k, v in h.items()} for h in history],
        description=f"ScalingInter-RL run {run_id}, stage {index} (horizon {horizon}): "
                    + tracker.run_link(child)
                    + (f". Trajectory viewer (offline HTML, MLflow artifact): {viewer}" if viewer else ""),
    )


@flow(name="stage", flow_run_name="stage-{index}-horizon-{horizon}", log_prints=True)
def stage_flow(config: PipelineConfig, run_id: str, parent_mlflow_id: str, index: int,
               horizon: int, iterations: int, start_iteration: int = 0,
               redo_steps: list[int] | None = None, env_steps_before: float = 0.0) -> dict[str, Any]:
    """Run one ScalingInter-RL stage: ``iterations`` RL iterations capped at ``horizon`` turns.

    ``start_iteration`` > 0 resumes the stage after a checkpoint taken mid-stage.
    ``redo_steps``: global steps a killed attempt logged from work the resume retracted; their
    metrics and evaluations are logged again (MLflow keeps both values; the later one counts).
    ``env_steps_before``: the environment steps the run played before ``start_iteration``; the
    summary's ``env_steps`` is the run's total at the stage's end, and the stage stops early once
    it reaches ``schedule.max_env_steps`` (its summary's ``budget_spent``).
    """
    with untagged_tasks():  # the tags stay on this flow run, off its task runs (flows/tagging.py)
        logger = get_run_logger()
        tracker = Tracker.from_config(config.tracking)
        child = tracker.stage_run(parent_mlflow_id, run_id, index, horizon, iterations)
        start = stage_start(config.stages, index)
        links = prefect_tags()
        tracker.set_tags(child, links)
        tracker.describe(child, stage_description(run_id, index, horizon, iterations, start,
                                                  links.get(TAG_FLOW_RUN_URL)))
        every = config.tracking.checkpoint_every
        redo = set(redo_steps or ())
        k = config.rollout.async_steps
        # (async) rollouts of the next iterations, oldest first: each plays after the one before it
        # (one engine plays one rollout at a time), with the weights synced at its start
        queued: deque[PrefectFuture] = deque()
        played, done = env_steps_before, iterations
        try:
            for it in range(start_iteration, iterations):
                if budget_spent(config, played):  # schedule.max_env_steps: the run ends here
                    done = it
                    break
                gs = start + it
                pos = position(config.stages, gs)
                assert (pos.stage, pos.horizon, pos.iteration) == (index, horizon, it), pos
                if queued:
                    rollout = queued.popleft().result()
                else:  # synchronous, and a stage's first iteration under async_steps
                    rollout = collect_rollouts(config, run_id, index, it, gs, horizon)
                # queue the rollouts up to k iterations ahead, never past the stage (its horizon)
                for nxt in range(it + 1 + len(queued), min(it + k, iterations - 1) + 1):
                    if queued:  # the sync waits for the rollout before it, in a worker thread
                        synced = sync_policy.submit(config, run_id, index, nxt, start + nxt, wait_for=[queued[-1]],
                                                     return_state=False)
                        queued.append(collect_rollouts.submit(config, run_id, index, nxt, start + nxt, horizon,
                                                              wait_for=[synced], return_state=False))
                    else:  # no rollout plays: sync here, before this iteration's update takes the weights
                        sync_policy(config, run_id, index, nxt, start + nxt)
                        queued.append(collect_rollouts.submit(config, run_id, index, nxt, start + nxt, horizon))
                adv = compute_advantages(config, run_id, index, it, gs)
                upd = update_policy(config, run_id, index, it, gs, sync=not k)
                metrics = {**iteration_metrics(rollout, adv, upd), "horizon": horizon}
                metrics.update(headline(metrics))
                played += metrics.get("env_steps", 0.0)
                # lineage first (MLflow keeps one input per dataset digest); then the metrics, which a
                # killed attempt may have logged past its checkpoint to one run or both
                tracker.log_trajectory_commit(
                    child, "episodes", index, it, TrajectoryStore.location(config.store.root, run_id, "episodes"),
                    rollout["digest"], rollout["rows"], profile=rollout)
                tracker.log_metrics_once([child, parent_mlflow_id], metrics, step=gs, again=gs in redo)
                # ...and the evaluation it may have run before its checkpoint
                if (config.tracking.eval_every and (gs + 1) % config.tracking.eval_every == 0
                        and (gs in redo or gs + 1 not in tracker.logged_steps(parent_mlflow_id, "eval/seconds"))):
                    if k:  # the engine must be free, then serve this update's weights
                        _drain(queued)
                        sync_policy(config, run_id, index, it + 1)
                    evaluate_live_run(config, run_id, EvalSettings(k=config.tracking.eval_k),
                                      EvalSink(mlflow_run_id=parent_mlflow_id, step=gs + 1))
                logger.info("stage %d iter %d (step %d, horizon %d): reward %.3f success %.2f",
                            index, it, gs, horizon, metrics["reward_mean"], metrics["success_rate"])
                progress.report("iteration", stage=index, horizon=horizon, global_step=gs, metrics=metrics,
                                env_steps=played)
                if every and (gs + 1) % every == 0 and it != iterations - 1 and not budget_spent(config, played):
                    save_checkpoint(config, run_id, child, index, gs + 1)
            if done == start_iteration > 0:  # resumed at the checkpoint where the budget ran out: it ends the stage
                checkpoint = tracker.run_checkpoint(child)
            else:
                checkpoint = save_checkpoint(config, run_id, child, index, start + done)
            if k:  # the next stage starts on this stage's last update
                sync_policy(config, run_id, index, iterations)
        except BaseException:  # the stage run must not stay RUNNING in MLflow; a re-run reopens it
            for pending in queued:  # rollouts still playing are waited for (each commit is kept or not)
                pending.wait()
            tracker.end_run(child, "FAILED")
            raise
        tracker.finish_stage(child)
        history = _stage_history(tracker, child)
        published = _for_readers("trajectory viewer", publish_viewer, config, run_id, parent_mlflow_id, index)
        viewer = published["uri"] if published else None
        _stage_artifact(tracker, run_id, index, horizon, child, history, viewer)
        return {**_stage_summary(history, child, index, horizon, iterations, checkpoint), "viewer": viewer,
                **_budget_summary(config, done, start + done, played)}


def _drain(queued: deque[PrefectFuture]) -> None:
    """Wait for the queued rollouts to finish (the engine is then free), keeping them queued; the
    first that failed raises here (those chained after it never started)."""
    for pending in queued:
        pending.result()


def _for_readers(what: str, publish: Any, *args: Any) -> Any:
    """Publish something made for people (the trajectory viewer, the learning curve); a failure
    to build it is logged, never fails the run (the training itself is committed by then)."""
    try:
        return publish(*args)
    except Exception as e:  # noqa: BLE001 - a reader's convenience must not fail training
        get_run_logger().warning("%s not published: %s: %s", what, type(e).__name__, e)
        return None


def _stage_summary(history: list[dict[str, Any]], child: str, index: int, horizon: int, iterations: int,
                   checkpoint: str | None) -> dict[str, Any]:
    """Per-stage numbers from the stage's ``_stage_history`` (a resumed run reports it whole)."""
    success = [h["success_rate"] for h in history if "success_rate" in h]
    reward = [h["reward_mean"] for h in history if "reward_mean" in h]
    return {
        "stage": index, "horizon": horizon, "iterations": iterations, "mlflow_run_id": child,
        "checkpoint": checkpoint,
        "success_rate": float(np.mean(success)) if success else float("nan"),
        "reward_mean": float(np.mean(reward)) if reward else float("nan"),
        "final_success_rate": success[-1] if success else float("nan"),
    }


@flow(name="scaling-inter-rl", flow_run_name=pipeline_run_name, log_prints=True)
def scaling_inter_rl(
    config: PipelineConfig = PipelineConfig(),  # noqa: B008
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Train an agent with the ScalingInter-RL curriculum described by ``config.schedule``.

    ``overrides`` (``field.path=value``, as ``agentgym train --set``) are applied to ``config``
    first: Prefect merges run parameters one level deep, so ``--param config=...`` replaces the
    whole config while ``--param overrides='["rollout.group_size=8"]'`` changes one field.

    Re-running with the same ``config.run_id`` resumes: finished stages are skipped and an
    unfinished one continues from the run's latest checkpoint, at the global step (and so the
    stage and horizon) where that checkpoint was taken. The flow run is named after the run id.

    Args:
        config: The whole pipeline: model, environments and their tasks, rollout, algorithm,
            trainer, ScalingInter-RL schedule (stages of growing horizon), trajectory store and
            MLflow tracking. Every field is described in docs/configuration.md. Leave run_id
            empty for a new run; set it to an earlier run's id to resume that run.
        overrides: Changes applied on top of config, one "field.path=value" string each (YAML
            values; list items by number), e.g. "rollout.group_size=8" or "envs.0.tasks=[1, 2]":
            the same syntax as `agentgym train --set`. Use it to change a few fields of a
            deployment's config; a partial config parameter would replace the whole config.
    """
    config = with_overrides(config, overrides)
    run_id = pipeline_run_id(config)  # made up by the flow run's name, when the config has none
    config = config.model_copy(update={"run_id": run_id})
    name_flow_run(run_id)
    tracker = Tracker.from_config(config.tracking)
    parent = tracker.pipeline_run(run_id, config.model_dump(mode="json"))
    links = prefect_tags()  # both ways: the Prefect flow run on the MLflow run, and back
    tracker.set_tags(parent, links)
    tracker.describe(parent, pipeline_description(config, run_id, links.get(TAG_FLOW_RUN_URL)))
    link_mlflow_run(run_id, tracker.run_url(parent))
    stages: list[dict[str, Any]] = []
    heldout: dict[str, dict[str, Any]] = {}  # policy label -> held-out result, in table order
    sft = None
    curve = None  # the learning curve's artifact URI, once a stage was evaluated
    try:
        if config.heldout.enabled:  # the floor and the starting point, before any training
            heldout["random-valid"] = heldout_random_valid(config, parent)
            if config.heldout.base:
                heldout["base"] = heldout_policy(config, parent, "base", config.model.name_or_path)
        if config.sft.enabled:
            with tags(*run_tags(run_id), "sft"):
                sft = sft_flow(config, run_id, parent)
            if config.heldout.enabled:
                heldout["sft"] = heldout_policy(config, parent, "sft", sft["checkpoint"])
        restored = restore_policy(config, run_id)
        start_step = restored["start_step"]
        if restored["retracted_steps"]:  # work of updates the checkpoint does not hold: redone
            tracker.set_tags(parent, {"agentgym.retracted_steps": ",".join(map(str, restored["retracted_steps"]))})
            get_run_logger().warning(
                "resuming at step %d: steps %s were done by updates after the last checkpoint; their "
                "rollouts or advantages were retracted (store _retracted/) and are done again (set "
                "tracking.checkpoint_every: 1 to lose less)", start_step, restored["retracted_steps"])
        budget = config.schedule.max_env_steps
        progress.report("start", total=total_steps(config.stages), done=start_step, run_id=run_id, budget=budget,
                        env_steps=env_steps_played(tracker, parent, start_step))
        for index, spec in enumerate(config.stages):
            first = stage_start(config.stages, index)
            if start_step >= first + spec.iterations:  # finished before: report it, skip it
                child = tracker.stage_run(parent, run_id, index, spec.horizon, spec.iterations)
                tracker.finish_stage(child)
                ckpt = restored["checkpoint"] if start_step == first + spec.iterations else None
                end = first + spec.iterations
                stages.append({**_stage_summary(_stage_history(tracker, child), child, index, spec.horizon,
                                                spec.iterations, ckpt),
                               **_budget_summary(config, spec.iterations, end, env_steps_played(tracker, parent, end))})
            else:
                resume_at = max(start_step, first)
                with tags(*run_tags(run_id), f"stage:{index}", f"horizon:{spec.horizon}"):
                    stages.append(stage_flow(config, run_id, parent, index, spec.horizon, spec.iterations,
                                             start_iteration=resume_at - first,
                                             redo_steps=[s for s in restored["retracted_steps"]
                                                         if first <= s < first + spec.iterations],
                                             env_steps_before=env_steps_played(tracker, parent, resume_at)))
            spent = stages[-1]["budget_spent"]  # schedule.max_env_steps: no later stage runs
            if spent:
                get_run_logger().info("schedule.max_env_steps=%d spent (%d environment steps) at step %d: the run "
                                      "ends after stage %d", config.schedule.max_env_steps, stages[-1]["env_steps"],
                                      stages[-1]["end_step"], index)
            last = index == len(config.stages) - 1 or spent
            if config.heldout.enabled and (config.heldout.every_stage or last):  # at the stage's end
                ckpt = tracker.run_checkpoint(stages[-1]["mlflow_run_id"])
                if ckpt is None:  # every stage ends with save_checkpoint
                    raise RuntimeError(f"stage {index} (MLflow run {stages[-1]['mlflow_run_id']}) has no "
                                       "checkpoint to evaluate held out")
                heldout[f"stage-{index}"] = heldout_policy(config, parent, f"stage-{index}", ckpt)
                curve = _for_readers("learning curve", publish_learning_curve, config, run_id, parent) or curve
            if spent:
                break
        table = publish_comparison(run_id, heldout, tracker.run_link(parent)) if heldout else []
        model = None
        if config.tracking.log_model and stages[-1]["checkpoint"]:
            model = log_final_policy(config, run_id, parent, stages[-1]["checkpoint"], stages[-1]["end_step"])
        tracker.finish_pipeline(parent)
    except BaseException:
        tracker.finish_pipeline(parent, "FAILED")
        raise
    finally:
        drop_session(run_id)
    result = {
        "run_id": run_id, "mlflow_run_id": parent, "tracking_uri": config.tracking.tracking_uri,
        "experiment": config.tracking.experiment, "store": TrajectoryStore.location(config.store.root, run_id),
        "mlflow_url": tracker.run_url(parent),
        "resumed_from_step": start_step, "stages": stages, "sft": sft, "heldout": table, "model": model,
        "learning_curve": curve,
    }
    _summary_artifact(tracker, result)
    return result


def _summary_artifact(tracker: Tracker, result: dict[str, Any]) -> None:
    """The run's summary as a markdown artifact of the top-level flow run (``summary-<run_id>``):
    per-stage table, held-out and in-training evaluation, links to MLflow."""
    from prefect.artifacts import create_markdown_artifact

    parent = result["mlflow_run_id"]
    links: dict[str, str | None] = {"mlflow": tracker.run_url(parent)}
    for s in result["stages"]:
        links[f"stage-{s['stage']}"] = tracker.run_url(s["mlflow_run_id"])
    viewer = next((s.get("viewer") for s in reversed(result["stages"]) if s.get("viewer")), None)
    if viewer:
        links["viewer"] = viewer
    model = result.get("model")
    if model:
        links["model"] = (f"`{model['model_uri']}`" + (f", registered as `models:/{model['registered_model_name']}/"
                                                       f"{model['version']}`" if model.get("version") else ""))
    metrics = tracker.last_metrics(parent)
    evals = {k: v for k, v in metrics.items() if k.startswith("eval/overall/")}
    run_id = result["run_id"]
    create_markdown_artifact(
        summary_markdown(run_id, result, links, evals), key=artifact_key("summary", run_id),
        description=f"Summary of ScalingInter-RL run {run_id}")
