"""`agentgym eval ...`: evaluate a policy, show the registered model and its champion.

Registered in ``agentgym_cli/cli.py`` with ``app.add_typer(eval_app, name="eval")``:

    agentgym eval run models:/agentgym-policy@champion -c configs/babyai.yaml --k 4
    agentgym eval run ./exported-folder -c configs/quickstart.yaml --set envs.0.eval_tasks=[80,81]
    agentgym eval champion --tracking-uri sqlite:///mlflow.db
"""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from agentgym_cli.common import console, prefect_server, quiet_env

eval_app = typer.Typer(no_args_is_help=True, help="Evaluate policies; inspect the model registry.")


def _cell(v: object) -> str:
    if isinstance(v, float):
        return "-" if not math.isfinite(v) else f"{v:.3f}"
    return "-" if v is None else str(v)


@eval_app.command("run")
def eval_run(
    model: str = typer.Argument(..., help="HF folder, checkpoint artifact URI, models:/name@alias, or tiny/smollm2."),
    config: Path = typer.Option(Path("configs/quickstart.yaml"), "--config", "-c", help="YAML config (its eval_tasks)."),
    set_: list[str] = typer.Option([], "--set", help="Override a field: --set envs.0.eval_tasks=[80,81]"),
    k: int = typer.Option(4, help="Samples per task for Avg@k / Pass@k."),
    greedy: bool = typer.Option(True, help="Also evaluate greedy decoding (greedy@1)."),
    seed: int = typer.Option(0, help="Evaluation seed (0: AgentGym's own task instances)."),
) -> None:
    """Evaluate MODEL on every environment's eval_tasks: Avg@k / Pass@k per env and category."""
    quiet_env()
    from agentgym.config import ConfigError, load_config

    try:
        cfg = load_config(config, set_)  # the one override path, as `agentgym train --set`
    except ConfigError as e:
        console.print(str(e), style="red", markup=False)
        raise typer.Exit(2) from None
    server = prefect_server()  # dies with this process (agentgym_cli/common.py)
    from agentgym.evaluation.metrics import EvalReport
    from flows.evaluate import evaluate_policy
    from tasks.evaluation import merged_table

    try:
        if server:
            server.wait()
        out = evaluate_policy(cfg, model=model, k=k, greedy_too=greedy, seed=seed)
    except ValueError as e:
        console.print(str(e), style="red", markup=False)
        raise typer.Exit(2) from None
    except Exception as e:
        from agentgym.tracking.prefect_db import prefect_disk_error

        named = prefect_disk_error(e)  # a full disk under Prefect's DB, else a bare HTTP 500
        if named is None:
            raise
        raise named from e
    reports = [EvalReport.from_dict(out["sampled"])] + ([EvalReport.from_dict(out["greedy"])] if greedy else [])
    rows = merged_table(reports)
    table = Table(title=f"{model}: score {_cell(out['score'])} (mean over envs of overall avg@{k})")
    for col in rows[0] if rows else []:
        table.add_column(col, justify="left" if col in ("env", "category") else "right")
    for r in rows:
        table.add_row(*(_cell(v) for v in r.values()))
    Console(soft_wrap=True).print(table)
    print(f"MLflow run {out['mlflow_run_id']} at {cfg.tracking.tracking_uri} (metrics eval/<env>/<category>/...)")


@eval_app.command("champion")
def eval_champion(
    name: str = typer.Option("agentgym-policy", help="Registered model name."),
    tracking_uri: str = typer.Option("sqlite:///mlflow.db", help="MLflow tracking (and registry) URI."),
) -> None:
    """List the versions of a registered model: aliases, retrain decision and scores."""
    quiet_env()
    from agentgym.registry.champion import ModelRegistry

    reg = ModelRegistry(tracking_uri)
    versions = reg.versions(name)
    if not versions:
        console.print(f"[yellow]no versions of {name!r} at {tracking_uri}[/yellow]")
        raise typer.Exit(1)
    champion = reg.champion(name)
    table = Table(title=f"{name} (champion: v{champion.version if champion else '-'})")
    for col in ("version", "aliases", "decision", "score", "champion score", "trained from", "run id"):
        table.add_column(col)
    for v in versions:
        aliases = ",".join(a for a in ("champion",) if champion and str(champion.version) == str(v.version))
        t = v.tags
        table.add_row(str(v.version), aliases or "-", t.get("agentgym.decision", "-"), t.get("agentgym.score", "-"),
                      t.get("agentgym.champion_score", "-"), t.get("agentgym.trained_from", "-"),
                      t.get("agentgym.run_id", "-"))
    Console(soft_wrap=True).print(table)
