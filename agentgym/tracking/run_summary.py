"""What a pipeline run says about itself in the UIs: MLflow run descriptions and the run's
summary (markdown for the Prefect flow run's artifact). Pure text from plain values; no MLflow,
no Prefect.
"""

from __future__ import annotations

import math
from typing import Any

from agentgym.config import PipelineConfig
from agentgym.store.trajectory_store import TrajectoryStore
from agentgym.tracking.artifact_keys import artifact_key


def _num(x: Any) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else (
        f"{x:.4f}" if isinstance(x, float) else str(x))


def _link(text: str, url: str | None) -> str:
    """A markdown link, or ``text`` alone without a URL. Keep ``text`` plain: the Prefect UI shows
    a code span's backticks in link text literally."""
    return f"[{text}]({url})" if url else text


def pipeline_description(config: PipelineConfig, run_id: str, prefect_url: str | None) -> str:
    """The pipeline MLflow run's description (``mlflow.note.content``)."""
    stages = " -> ".join(f"h{s.horizon} x {s.iterations}" for s in config.stages)
    envs = ", ".join(sorted({e.name for e in config.envs}))
    lines = [
        f"ScalingInter-RL run `{run_id}`: {config.algorithm.estimator.value} on {envs}, "
        f"model `{config.model.name_or_path}`, stages (horizon x iterations) {stages}"
        + (", after an SFT warm start" if config.sft.enabled else "") + ".",
        "",
        f"- trajectories: `{TrajectoryStore.location(config.store.root, run_id)}` (Parquet: episodes, turns, advantages)",
        ("- " + _link("Prefect flow run", prefect_url) + f" (`{run_id}`)" if prefect_url else
         f"- Prefect flow run `{run_id}` (on a temporary Prefect server, gone since the run ended: no page to link)"),
        f"- resume: `agentgym train -c <config> --run-id {run_id}`",
    ]
    return "\n".join(lines)


def stage_description(run_id: str, index: int, horizon: int, iterations: int, first_step: int,
                      prefect_url: str | None) -> str:
    """A stage MLflow run's description."""
    return (f"Stage {index} of ScalingInter-RL run `{run_id}`: {iterations} iteration(s) with at most "
            f"{horizon} turns per episode (global steps {first_step}-{first_step + iterations - 1}); "
            f"metrics per iteration, checkpoints under `checkpoints/`. "
            + _link("Prefect stage flow run", prefect_url) + ".")


def sft_description(run_id: str, episodes: int, epochs: int, prefect_url: str | None) -> str:
    return (f"SFT warm start of run `{run_id}`: {episodes} scripted-expert demonstrations, {epochs} "
            f"epoch(s); its final checkpoint is the RL stages' step 0. " + _link("Prefect flow run", prefect_url)
            + ".")


def summary_markdown(run_id: str, result: dict[str, Any], links: dict[str, str | None],
                     eval_metrics: dict[str, float] | None = None) -> str:
    """The run's summary: per-stage table, held-out and in-training evaluation, where things are.

    ``result`` is what ``scaling-inter-rl`` returns; ``links``: ``mlflow`` (pipeline run URL),
    ``stage-<i>`` (stage run URLs), ``model`` (registered version, text), ``viewer`` (the
    trajectory viewer's artifact URI); ``eval_metrics``: the
    last ``eval/.../overall/...`` values of the pipeline run (``tracking.eval_every``)."""
    out = [f"## ScalingInter-RL run `{run_id}`", ""]
    if result.get("resumed_from_step"):
        out += [f"Resumed at global step {result['resumed_from_step']}.", ""]
    out += ["| stage | horizon | iterations | success (mean) | success (last) | reward (mean) | MLflow |",
            "|---|---|---|---|---|---|---|"]
    for s in result["stages"]:
        out.append(f"| {s['stage']} | {s['horizon']} | {s['iterations']} | {_num(s['success_rate'])} | "
                   f"{_num(s['final_success_rate'])} | {_num(s['reward_mean'])} | "
                   + _link("stage run", links.get(f"stage-{s['stage']}")) + " |")
    if result.get("sft"):
        sft = result["sft"]
        out += ["", f"SFT warm start: held-out demonstration loss {_num(sft.get('heldout_loss_before'))} -> "
                    f"{_num(sft.get('heldout_loss_after'))} ({sft.get('steps')} steps)."]
    heldout = result.get("heldout") or []
    if heldout:
        cols = list(dict.fromkeys(k for row in heldout for k in row))
        out += ["", "### Held-out evaluation (success, greedy@1; random-valid: mean over seeds)", "",
                "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        out += ["| " + " | ".join(_num(row.get(c)) for c in cols) + " |" for row in heldout]
    if eval_metrics:
        out += ["", "### Evaluation during training (last step, overall)", "",
                "| metric | value |", "|---|---|"]
        out += [f"| `{k}` | {_num(v)} |" for k, v in sorted(eval_metrics.items())]
    out += ["", "### Where things are", "",
            "- MLflow: " + _link(f"pipeline run {result['mlflow_run_id']}", links.get("mlflow"))
            + f" (tracking URI `{result['tracking_uri']}`, experiment `{result['experiment']}`)",
            f"- trajectories: `{result['store']}` (`pd.read_parquet(\".../episodes\", "
            "schema=dataset_schema(\"episodes\"))`, columns in docs/datasets.md)",
            f"- final checkpoint: `{result['stages'][-1]['checkpoint']}`" if result["stages"] else "",
            f"- Prefect artifacts: per-stage tables `stage-<i>-{artifact_key(run_id)}`"
            + (f", held-out table `{artifact_key('heldout', run_id)}`" if heldout else "")]
    if links.get("viewer"):
        out.append(f"- trajectory viewer (one offline HTML file, MLflow artifact): `{links['viewer']}`")
    if links.get("model"):
        out.append(f"- model: {links['model']}")
    return "\n".join(line for line in out if line is not None)
