"""Flow ``evaluate-policy``: score a checkpoint on every environment's held-out tasks.

    evaluate-policy(config, model, k=4, greedy_too=True)
      └─ evaluate_model  (Avg@k / Pass@k sampled, greedy@1)  -> MLflow run + Prefect table

``model`` is a local HF folder, a checkpoint artifact URI (what ``scaling-inter-rl`` returns in
``stages[-1].checkpoint``), ``models:/<name>@<alias>`` / ``models:/<name>/<version>``, or a model
name (``tiny``, ``smollm2``). The scores go to a new MLflow run (``agentgym.kind=evaluation``) in
the config's experiment, as ``eval/<env>/<category>/avg_at_<k>``, ``.../pass_at_<k>``,
``.../greedy_at_1`` and ``eval/overall/...`` (MLflow allows no ``@`` in metric names).
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from agentgym.config import PipelineConfig, with_overrides
from agentgym.tracking.tracker import Tracker
from tasks.evaluation import EvalSettings, EvalSink, evaluate_model


@flow(name="evaluate-policy", log_prints=True)
def evaluate_policy(
    config: PipelineConfig = PipelineConfig(),  # noqa: B008
    model: str = "models:/agentgym-policy@champion",
    k: int = 4,
    greedy_too: bool = True,
    seed: int = 0,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Evaluate ``model`` on every env's ``eval_tasks`` (Avg@k, Pass@k, greedy), log to MLflow."""
    config = with_overrides(config, overrides)
    if not any(e.eval_tasks for e in config.envs):
        raise ValueError("no environment has eval_tasks; add held-out task ids, e.g. "
                         "overrides=['envs.0.eval_tasks=[100, 101]'] or eval_tasks: [...] in the config")
    tracker = Tracker.from_config(config.tracking)
    mlflow_run_id = tracker.open_run(
        "evaluation", f"eval-{model.rsplit('/', 1)[-1]}", {"agentgym.model": model, "agentgym.eval_seed": str(seed)},
        {"model": model, "k": k, "greedy_too": greedy_too, "seed": seed,
         "eval_tasks": {e.name: e.eval_tasks for e in config.envs}})
    try:
        result = evaluate_model(config, model, EvalSettings(k=k, greedy_too=greedy_too, seed=seed),
                                EvalSink(mlflow_run_id=mlflow_run_id, label=f"policy-{model}"))
    except BaseException:
        tracker.end_run(mlflow_run_id, "FAILED")
        raise
    tracker.end_run(mlflow_run_id)
    print(f"evaluation of {model}: score {result['score']:.4f}"
          + (f", greedy {result['greedy_score']:.4f}" if greedy_too else ""))
    return {"mlflow_run_id": mlflow_run_id, **result}
