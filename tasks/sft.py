"""Prefect tasks of the SFT warm start: write the expert demonstrations, fine-tune on them.

Both return small dicts. The demonstrations go to the trajectory store under their own dataset id
(``agentgym.training.sft.demo_dataset``), so runs with the same settings share them; the fine-tuned policy
goes to MLflow as the run's first checkpoint (global step 0), which ``restore_policy`` then loads
for the RL stages.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from transformers import AutoTokenizer
from prefect.cache_policies import NO_CACHE

from agentgym.chat import ChatFormatter
from agentgym.config import PipelineConfig
from agentgym.infra import progress, tempdirs
from agentgym.models.folders import resolve_model
from agentgym.registry.champion import materialize
from agentgym.store.trajectory_store import TrajectoryStore
from agentgym.tracking.tracker import Tracker
from agentgym.training import sft as S
from agentgym.training.demos import EXPERT_POLICY_VERSION, generate_demos
from agentgym.training.zero_stage import TRAINER_STATE
from env_adapters import make_env
from env_adapters.experts import make_expert


def _demo_store(config: PipelineConfig) -> TrajectoryStore:
    dataset = S.demo_dataset(config, config.model.name_or_path)
    return TrajectoryStore(config.store.root, dataset, config.store.storage_options)


@task(name="generate_demonstrations", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def generate_demonstrations(config: PipelineConfig) -> dict[str, Any]:
    """Play the scripted experts on the training tasks (and ``sft.heldout_episodes`` on the
    eval tasks) and commit the successful episodes; reuses a committed set."""
    s = config.sft
    store = _demo_store(config)
    tokenizer = AutoTokenizer.from_pretrained(
        str(resolve_model(config.model.name_or_path, config.model.cache_dir)), local_files_only=True)
    formatter = ChatFormatter(tokenizer, config.rollout.response_prefix)
    out: dict[str, Any] = {"dataset": store.run_id, "uri": store.path("episodes")}
    parts = [(S.TRAIN_PART, s.episodes, [(e.name, e.tasks, e.kwargs) for e in config.envs])]
    held = [(e.name, e.eval_tasks, e.kwargs) for e in config.envs if e.eval_tasks]
    if s.heldout_episodes and held:
        parts.append((S.HELDOUT_PART, s.heldout_episodes, held))
    for part, wanted, envs in parts:
        name = "train" if part == S.TRAIN_PART else "heldout"
        existing = store.manifest("episodes", 0, part)
        if existing is not None:
            out[name] = {"rows": existing.rows, "digest": existing.digest, "reused": True}
            continue
        def on_episode(done: int, total: int, n: str = name) -> None:
            progress.report("phase", name=f"demos ({n})", done=done, total=total)

        episodes, stats = generate_demos(
            formatter, envs, episodes=wanted, horizon=s.horizon, stop=list(config.rollout.stop),
            system_prompt=config.system_prompt, noise=s.noise, seed=s.seed + part * 7_919,
            max_attempts=s.attempts_per_episode * wanted,
            make_env=make_env, make_expert=make_expert, on_episode=on_episode,
        )
        if len(episodes) < wanted:
            raise RuntimeError(
                f"the scripted experts solved only {len(episodes)} of {stats.attempted} {name} attempts "
                f"({wanted} wanted); list easier tasks in envs[].tasks (or eval_tasks), raise "
                "sft.horizon or sft.attempts_per_episode, or lower sft.episodes")
        manifest = store.write_episodes(episodes, stage=0, iteration=part, global_step=0,
                                        policy_version=EXPERT_POLICY_VERSION)
        out[name] = {"rows": manifest.rows, "digest": manifest.digest, "reused": False,
                     "attempted": stats.attempted, "expert_success_rate": stats.success_rate,
                     "expert_turns": stats.expert_turns, "noise_turns": stats.noise_turns,
                     "reply_tokens": stats.reply_tokens, "tokens": stats.tokens,
                     "actions": stats.actions, "seconds": stats.seconds}
    get_run_logger().info("demonstrations %s: %s", store.run_id, out)
    return out


@task(name="sft_train", task_run_name="sft_train[{run_id}]", cache_policy=NO_CACHE)
def sft_train(config: PipelineConfig, run_id: str, sft_mlflow_id: str, demos: dict[str, Any]) -> dict[str, Any]:
    """Fine-tune the base policy on the demonstrations; checkpoint each epoch; log the final
    policy as the run's step-0 checkpoint. A re-run after a kill resumes after the last
    finished epoch (each metric step is logged once)."""
    logger = get_run_logger()
    s = config.sft
    tracker = Tracker.from_config(config.tracking)
    store = _demo_store(config)
    train = store.read_episodes(0, S.TRAIN_PART)
    heldout = store.read_episodes(0, S.HELDOUT_PART) if "heldout" in demos else []
    per_epoch = S.steps_per_epoch(len(train), s.batch_size)
    total = per_epoch * s.epochs
    base = resolve_model(config.model.name_or_path, config.model.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    resume = tracker.sft_epoch_checkpoint(sft_mlflow_id)
    weights, state = base, S.SFTState()
    if resume is not None:
        resume_uri, epoch = resume
        weights, state = materialize(resume_uri, config.tracking.tracking_uri, config.model.cache_dir), \
            S.SFTState(step=(epoch + 1) * per_epoch, epoch=epoch + 1)
        logger.info("SFT resumes after epoch %d from %s", epoch, resume_uri)
    trainer = S.build_trainer(config, weights, tokenizer, total)
    trainer_state = Path(weights) / TRAINER_STATE
    if resume is not None and trainer_state.is_dir():
        trainer.load_checkpoint(trainer_state)
    elif state.step:  # weights only: the LR schedule continues where it was, AdamW restarts
        trainer.advance_lr_schedule(state.step)
    t0 = time.perf_counter()

    def heldout_metrics(step: int) -> dict[str, float]:
        if not heldout:
            return {}
        m = trainer.sft_metrics(S.as_batch(heldout, trainer.pad_id))
        metrics = {"heldout_loss": m["sft_loss"], "heldout_token_accuracy": m["token_accuracy"]}
        tracker.log_metrics_once([sft_mlflow_id], metrics, step=step, key="heldout_loss")
        return metrics

    def on_step(step: int, metrics: dict[str, Any]) -> None:
        tracker.log_metrics_once([sft_mlflow_id], metrics, step=step, key="sft_loss")
        progress.report("phase", name="SFT steps", done=step, total=total,
                        postfix={"loss": f"{metrics['sft_loss']:.3f}", "acc": f"{metrics['token_accuracy']:.2f}"})

    before: dict[str, float] = {}
    after: dict[str, float] = {}
    uri: str | None = None
    try:
        before = heldout_metrics(0) if state.step == 0 else {}
        step = state.step
        for epoch in range(state.epoch, s.epochs):
            step = S.train_epoch(trainer, train, config, epoch, step, on_step)
            after = heldout_metrics(step)
            last = epoch == s.epochs - 1
            with tempdirs.scratch("agentgym-sft-") as tmp:
                trainer.save_hf(tmp, tokenizer)
                if config.tracking.checkpoint_trainer_state and not last:
                    trainer.save_checkpoint(Path(tmp, TRAINER_STATE), {"sft_step": step})
                if last:
                    uri = tracker.log_checkpoint(sft_mlflow_id, tmp, 0, meta={
                        "run_id": run_id, "stage": "sft", "policy_version": 0, "kind": "sft",
                        "demos": store.run_id, "sft_steps": step})
                else:
                    tracker.log_sft_epoch_checkpoint(sft_mlflow_id, tmp, epoch)
    finally:
        trainer.close()
    seconds = time.perf_counter() - t0
    logger.info("SFT done: %d steps in %.0f s; held-out loss %s -> %s", step, seconds,
                before.get("heldout_loss"), after.get("heldout_loss"))
    return {"checkpoint": uri, "steps": step, "seconds": seconds, "demos": len(train),
            "heldout_before": before, "heldout_after": after}
