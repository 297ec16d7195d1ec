"""The SFT warm start as a Prefect subflow: demonstrations, then supervised fine-tuning.

    sft(config, run_id)
      ├─ generate_demonstrations   scripted experts -> trajectory store (its own dataset id)
      └─ sft_train                 DeepSpeed, cross-entropy on the expert's reply tokens
                                   -> MLflow: the SFT child run's metrics, its checkpoint (step 0)

It runs before the ScalingInter-RL stages when ``sft.enabled``; the RL stages then start from
its checkpoint (``restore_policy`` takes it as the run's step-0 checkpoint). A finished SFT stage
is skipped on resume; a killed one continues after its last finished epoch.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from agentgym.config import PipelineConfig
from agentgym.tracking.run_summary import sft_description
from agentgym.tracking.tracker import Tracker
from flows.tagging import untagged_tasks
from tasks.links import TAG_FLOW_RUN_URL, prefect_tags
from tasks.sft import generate_demonstrations, sft_train

SFT_PARAMS = ("episodes", "heldout_episodes", "horizon", "noise", "epochs", "batch_size", "learning_rate",
              "warmup_steps", "seed")


def _summary(tracker: Tracker, child: str) -> dict[str, Any]:
    """The SFT run's numbers, read back from MLflow (also for a stage finished by an earlier attempt)."""
    def history(key: str) -> list[float]:
        return [value for _, value in tracker.metric_steps(child, key)]

    held = history("heldout_loss")
    acc = history("heldout_token_accuracy")
    loss = history("sft_loss")
    return {
        "mlflow_run_id": child, "steps": len(loss),
        "train_loss_first": loss[0] if loss else None, "train_loss_last": loss[-1] if loss else None,
        "heldout_loss_before": held[0] if held else None, "heldout_loss_after": held[-1] if held else None,
        "heldout_accuracy_before": acc[0] if acc else None, "heldout_accuracy_after": acc[-1] if acc else None,
        "checkpoint": tracker.run_checkpoint(child),
    }


@flow(name="sft", flow_run_name="sft-{run_id}", log_prints=True)
def sft_flow(config: PipelineConfig, run_id: str, parent_mlflow_id: str) -> dict[str, Any]:
    """Write the demonstrations and fine-tune the base policy on them (skipped when finished)."""
    with untagged_tasks():  # the tags stay on this flow run, off its task runs (flows/tagging.py)
        tracker = Tracker.from_config(config.tracking)
        child = tracker.sft_run(parent_mlflow_id, run_id, {k: getattr(config.sft, k) for k in SFT_PARAMS})
        links = prefect_tags()
        tracker.set_tags(child, links)
        tracker.describe(child, sft_description(run_id, config.sft.episodes, config.sft.epochs,
                                                links.get(TAG_FLOW_RUN_URL)))
        if tracker.is_finished(child):
            return _summary(tracker, child)
        try:
            demos = generate_demonstrations(config)
            for part, name in ((0, "train"), (1, "heldout")):
                if name in demos:  # lineage: the exact demonstration commits the policy learned from
                    tracker.log_trajectory_commit(child, "demos", 0, part, demos["uri"], demos[name]["digest"],
                                                  demos[name]["rows"], profile=demos[name])
            stats = {f"demos_{k}": v for k, v in demos["train"].items() if isinstance(v, (int, float))}
            tracker.log_metrics_once([child], stats, step=0, key="demos_rows")
            sft_train(config, run_id, child, demos)
        except BaseException:  # like a stage run: never left RUNNING; a re-run reopens it
            tracker.end_run(child, "FAILED")
            raise
        tracker.finish_stage(child)
        return _summary(tracker, child)
