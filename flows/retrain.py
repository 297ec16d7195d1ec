"""Flow ``retrain``: train a challenger from the champion, evaluate both, promote or keep.

    retrain(config, registered_model="agentgym-policy", margin=0.0)
      ├─ champion = models:/<registered_model>@champion (if any) -> its HF folder, the start weights
      ├─ scaling-inter-rl(config with a new run id)          (subflow: stages, fresh rollouts)
      ├─ evaluate_model(challenger), evaluate_model(champion)
      │     same config, same held-out tasks, same seed: the same task instances for both
      ├─ register the challenger's final checkpoint as a new model version
      └─ move the ``champion`` alias iff challenger >= champion + margin (first run: always)

The decision, both scores and the reason are recorded three times: as tags/metrics of the
``retrain`` MLflow run (``agentgym.kind=retrain``), as tags of the new model version, and as a
Prefect markdown + table artifact (key ``retrain-<registered_model>``, so the UI keeps their
history). The score is the mean over environments of the overall sampled Avg@k
(:attr:`agentgym.evaluation.metrics.EvalReport.score`).

The ``retrain/nightly`` deployment (``deployments/prefect.yaml``) runs this on a cron schedule.
"""

from __future__ import annotations

import math
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from agentgym.config import PipelineConfig
from agentgym.config import with_overrides
from agentgym.evaluation.metrics import EvalReport
from agentgym.registry.champion import CHAMPION, ModelRegistry, decide, materialize
from agentgym.tracking.tracker import Tracker
from flows.train import scaling_inter_rl
from agentgym.tracking.artifact_keys import artifact_key
from tasks.evaluation import EvalSettings, EvalSink, evaluate_model
from tasks.links import new_run_id


def _fmt(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.4f}"


@flow(name="retrain", log_prints=True)
def retrain(
    config: PipelineConfig = PipelineConfig(),  # noqa: B008
    registered_model: str = "agentgym-policy",
    margin: float = 0.0,
    k: int = 4,
    eval_seed: int = 0,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Retrain from the champion on fresh rollouts; promote the challenger if it scores
    ``>= champion + margin`` on the held-out tasks (the first model is always promoted)."""
    logger = get_run_logger()
    config = with_overrides(config, overrides)
    if not any(e.eval_tasks for e in config.envs):
        raise ValueError("retrain compares challenger and champion on held-out tasks, and no environment "
                         "has eval_tasks; add some, e.g. eval_tasks: [100, 101, 102] under an env")
    uri = config.tracking.tracking_uri
    registry = ModelRegistry(uri)
    tracker = Tracker.from_config(config.tracking)
    champion = registry.champion(registered_model)
    cv = str(champion.version) if champion is not None else None  # MLflow returns an int
    train_id = f"retrain-{new_run_id()}"
    rid = tracker.open_run(
        "retrain", train_id, {"agentgym.run_id": train_id, "agentgym.registered_model": registered_model,
                              "agentgym.champion_before": cv or "none"},
        {"registered_model": registered_model, "margin": margin, "k": k, "eval_seed": eval_seed,
         "base_model": config.model.name_or_path, "champion_before": cv or "none"})
    try:
        champion_path = None
        train_cfg = config
        if champion is not None:
            # pin the version (not the alias): the alias may move while this run trains
            champion_path = materialize(f"models:/{registered_model}/{cv}", uri, config.model.cache_dir)
            train_cfg = train_cfg.model_copy(update={
                "model": train_cfg.model.model_copy(update={"name_or_path": str(champion_path)})})
            logger.info("starting from champion v%s (%s)", cv, champion_path)
        else:
            logger.info("no champion of %r yet: starting from %s", registered_model, config.model.name_or_path)
        # this flow registers the challenger itself, by decision: the training run registers nothing
        train_cfg = train_cfg.model_copy(update={"run_id": train_id, "tracking": train_cfg.tracking.model_copy(
            update={"registered_model_name": None})})
        trained = scaling_inter_rl(train_cfg)
        last = trained["stages"][-1]
        challenger_uri = last["checkpoint"]
        same = EvalSettings(k=k, seed=eval_seed)  # both on the same held-out tasks and seed
        chal = evaluate_model(config, challenger_uri, same, EvalSink(
            mlflow_run_id=rid, prefix="challenger", publish=False, label=f"{train_id}-challenger"))
        champ = None
        if champion_path is not None:
            champ = evaluate_model(config, str(champion_path), same, EvalSink(
                mlflow_run_id=rid, prefix="champion", publish=False, label=f"{train_id}-champion-v{cv}"))
        decision = decide(chal["score"], champ["score"] if champ else None, margin)
        version = registry.register(
            registered_model, source=challenger_uri, run_id=last["mlflow_run_id"],
            description=f"retrain {train_id}: {decision.reason}",
            tags={"agentgym.run_id": train_id, "agentgym.retrain_mlflow_run": rid,
                  "agentgym.trained_from": f"v{cv}" if cv else config.model.name_or_path,
                  "agentgym.eval_seed": eval_seed, "agentgym.k": k, "agentgym.margin": margin,
                  "agentgym.score": _fmt(decision.challenger_score),
                  "agentgym.champion_score": _fmt(decision.champion_score),
                  "agentgym.champion_version": cv or "none",
                  "agentgym.decision": decision.label, "agentgym.reason": decision.reason},
        )
        nv = str(version.version)
        if decision.promote:
            registry.set_alias(registered_model, nv, CHAMPION)
            if cv is not None:
                registry.tag_version(registered_model, cv, {"agentgym.replaced_by": f"v{nv}"})
        champion_after = nv if decision.promote else cv
        metrics = {"challenger_score": decision.challenger_score, "promoted": float(decision.promote),
                   "margin": margin}
        if decision.champion_score is not None:
            metrics["champion_score"] = decision.champion_score
            metrics["score_delta"] = decision.challenger_score - decision.champion_score
        tracker.log_metrics(rid, metrics, step=0)
        for key, val in {"agentgym.decision": decision.label, "agentgym.reason": decision.reason,
                         "agentgym.challenger_version": nv,
                         "agentgym.champion_after": champion_after,
                         "agentgym.train_mlflow_run": trained["mlflow_run_id"]}.items():
            tracker.set_tags(rid, {key: val})
    except BaseException:
        tracker.end_run(rid, "FAILED")
        raise
    tracker.end_run(rid)

    reports = [EvalReport.from_dict(chal["sampled"])]
    if champ:
        reports.append(EvalReport.from_dict(champ["sampled"]))
    md = "\n".join([
        f"## Retrain `{train_id}`: challenger **{decision.label}**",
        "",
        "| | version | score |",
        "|---|---|---|",
        f"| challenger | v{nv} | {_fmt(decision.challenger_score)} |",
        f"| champion | {'v' + cv if cv else '-'} | {_fmt(decision.champion_score)} |",
        "",
        f"Rule: promote iff challenger >= champion + margin ({margin:g}); {decision.reason}.",
        f"`champion` alias of `{registered_model}` is now v{champion_after}. "
        f"Score = mean over environments of overall Avg@{k}, seed {eval_seed}, "
        f"the same held-out tasks for both. MLflow run `{rid}`, training run `{train_id}`.",
    ])
    create_markdown_artifact(md, key=artifact_key("retrain", registered_model), description="retrain decision")
    table = []
    for who, rep in zip(("challenger", "champion"), reports):
        for row in rep.table():
            table.append({"model": who, **row})
    create_table_artifact(table, key=artifact_key("retrain", registered_model, "scores"),
                          description=f"challenger vs champion per category ({train_id})")
    print(f"retrain {train_id}: challenger v{nv} {_fmt(decision.challenger_score)} vs champion "
          f"{_fmt(decision.champion_score)} -> {decision.label}")
    return {
        "decision": decision.label, "promoted": decision.promote, "reason": decision.reason,
        "challenger_score": decision.challenger_score, "champion_score": decision.champion_score,
        "challenger_version": nv, "champion_before": cv,
        "champion_after": champion_after, "run_id": train_id, "mlflow_run_id": rid,
        "train_mlflow_run_id": trained["mlflow_run_id"], "checkpoint": challenger_uri,
    }
