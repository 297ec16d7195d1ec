"""`agentgym` command line: train, prepare models, serve and check environments, inspect configs,
inspect and view a run's trajectories.

`python -m agentgym_cli.cli` is the same as the `agentgym` console script."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from agentgym_cli.common import console, prefect_server, quiet_env
from agentgym_cli.eval_cmd import eval_app
from agentgym_cli.gateway_cmd import gateway_app
from agentgym_cli.inspect_cmd import inspect_cmd, view_cmd

app = typer.Typer(add_completion=False, no_args_is_help=True, help="AgentGym-RL on Prefect.")
models_app = typer.Typer(no_args_is_help=True, help="Prepare and inspect models.")
env_app = typer.Typer(no_args_is_help=True, help="Run environments.")
config_app = typer.Typer(no_args_is_help=True, help="Inspect configuration.")
app.add_typer(models_app, name="models")
app.add_typer(env_app, name="env")
app.add_typer(config_app, name="config")
app.add_typer(eval_app, name="eval")
app.add_typer(gateway_app, name="gateway")
app.command("inspect")(inspect_cmd)
app.command("view")(view_cmd)


@app.command()
def train(
    config: Path = typer.Option(Path("configs/quickstart.yaml"), "--config", "-c", help="YAML config."),
    set_: list[str] = typer.Option([], "--set", help="Override a field: --set rollout.group_size=8"),
    run_id: Optional[str] = typer.Option(None, help="Run id; reuse one to resume it."),
) -> None:
    """Run the ScalingInter-RL pipeline as a Prefect flow, with a progress bar and a summary.
    With `rollout.engine: vllm` and no vllm here, it runs in .venv-vllm (same arguments)."""
    quiet_env()
    from agentgym_cli.vllm_env import reexec_in, vllm_env_python

    python = vllm_env_python(config, set_)
    if python:
        console.print(f"rollout.engine=vllm: running in the vLLM environment ({python})", markup=False)
        reexec_in(python, sys.argv[1:])
    from agentgym.config import ConfigError, load_config

    try:
        cfg = load_config(config, set_)
    except ConfigError as e:
        console.print(str(e), style="red", markup=False)
        raise typer.Exit(2) from None
    if run_id:
        cfg = cfg.model_copy(update={"run_id": run_id})
    server = prefect_server()  # starts while the flows are imported; dies with this process
    from tqdm import tqdm

    from agentgym.infra import progress

    bar: dict[str, tqdm] = {}
    in_env_steps: dict[str, bool] = {}  # "it": the run's bar counts environment steps (a budget)

    def hook(event: str, data: dict) -> None:
        if event == "start":
            if data.get("budget"):  # schedule.max_env_steps ends the run: count environment steps
                bar["it"] = tqdm(total=data["budget"], initial=int(data.get("env_steps", 0)), unit=" env step",
                                 desc=f"run {data['run_id']}", file=sys.stderr, dynamic_ncols=True)
            else:
                bar["it"] = tqdm(total=data["total"], initial=data.get("done", 0), desc=f"run {data['run_id']}",
                                 unit="iter", file=sys.stderr, dynamic_ncols=True)
            in_env_steps["it"] = bool(data.get("budget"))
        elif event == "phase":  # demonstrations, SFT steps: a bar of their own each
            name = str(data["name"])
            if name not in bar:
                bar[name] = tqdm(total=data["total"], desc=name, file=sys.stderr, dynamic_ncols=True, leave=False)
            b = bar[name]
            b.update(int(data["done"]) - b.n)
            if data.get("postfix"):
                b.set_postfix(**data["postfix"])
            if data["done"] >= data["total"]:
                b.close()
        elif event == "iteration" and "it" in bar:
            m = data["metrics"]
            b = bar["it"]
            b.set_postfix(stage=data["stage"], horizon=data["horizon"], step=data["global_step"],
                          reward=f"{m.get('reward_mean', float('nan')):.2f}",
                          success=f"{m.get('success_rate', float('nan')):.2f}")
            # a budget bar may end past its total: the iteration that spends the budget counts whole
            b.update(int(data.get("env_steps", 0)) - b.n if in_env_steps.get("it") else 1)

    progress.install(hook)
    from agentgym.tracking.prefect_db import prefect_disk_error
    from agentgym.tracking.tracker import ResumeConflict
    from flows.train import scaling_inter_rl
    from tasks.links import new_run_id

    # the id is fixed here, not in the flow, so that a failed run can be told how to resume
    cfg = cfg if cfg.run_id else cfg.model_copy(update={"run_id": new_run_id()})
    resume = (f"agentgym train -c {shlex.quote(str(config))}"
              + "".join(f" --set {shlex.quote(s)}" for s in set_) + f" --run-id {cfg.run_id}")
    t0 = time.perf_counter()
    try:
        if server:
            server.wait()
        result = scaling_inter_rl(cfg)
    except (KeyboardInterrupt, Exception) as e:  # noqa: BLE001 - reported with the way back in
        if "it" in bar:
            bar["it"].close()
        if isinstance(e, KeyboardInterrupt):
            console.print(f"interrupted; resume from the latest checkpoint with:\n  {resume}",
                          soft_wrap=True, markup=False)
            raise typer.Exit(130) from None
        # a full disk under Prefect's own database surfaces as a bare HTTP 500: name it
        e = prefect_disk_error(e) or e
        console.print(f"run {cfg.run_id} failed: {type(e).__name__}: {e}", style="red", markup=False,
                      soft_wrap=True)
        if not isinstance(e, (ConfigError, ResumeConflict)):  # those fail again unchanged
            console.print(f"resume it from its latest checkpoint:\n  {resume}", soft_wrap=True, markup=False)
        raise typer.Exit(1) from None
    if "it" in bar:
        bar["it"].close()
    _print_summary(result, time.perf_counter() - t0)


def _print_summary(result: dict, seconds: float) -> None:
    out = Console(soft_wrap=True)
    table = Table(title=f"ScalingInter-RL run {result['run_id']} ({seconds / 60:.1f} min)")
    for col in ("stage", "horizon", "iterations", "success rate", "final success", "reward mean"):
        table.add_column(col, justify="right")
    for s in result["stages"]:
        done = s.get("iterations_done", s["iterations"])
        table.add_row(str(s["stage"]), str(s["horizon"]),
                      str(s["iterations"]) if done == s["iterations"] else f"{done} of {s['iterations']}",
                      f"{s['success_rate']:.3f}", f"{s['final_success_rate']:.3f}", f"{s['reward_mean']:.3f}")
    out.print(table)
    last = result["stages"][-1] if result["stages"] else {}
    if last.get("budget_spent"):
        out.print(f"env-step budget spent (schedule.max_env_steps): {last['env_steps']:.0f} environment steps by "
                  f"step {last['end_step']}; the later iterations and stages did not run")
    if result.get("sft"):
        s = result["sft"]
        fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        out.print(f"SFT warm start: {s['steps']} steps; held-out demo loss {fmt(s['heldout_loss_before'])} -> "
                  f"{fmt(s['heldout_loss_after'])}, token accuracy {fmt(s['heldout_accuracy_before'])} -> "
                  f"{fmt(s['heldout_accuracy_after'])}")
    if result.get("heldout"):
        rows = result["heldout"]
        cols = [c for c in rows[0] if c != "policy"]
        held = Table(title="Held-out success (random-valid: mean over seeds; policies: greedy@1)")
        held.add_column("policy")
        for c in cols:
            held.add_column(c, justify="right")
        for r in rows:
            held.add_row(r["policy"], *[("-" if r.get(c) is None else
                                         f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c])) for c in cols])
        out.print(held)
    out.print(f"run id:        {result['run_id']}"
              + (f" (resumed at step {result['resumed_from_step']})" if result.get("resumed_from_step") else ""))
    out.print(f"trajectories:  {result['store']}")
    out.print(f"MLflow:        {result['tracking_uri']} (experiment '{result['experiment']}', "
              f"run {result['mlflow_run_id']})")
    if result.get("mlflow_url"):  # the run's page in MLflow's classic (training) view
        ui = "" if str(result["tracking_uri"]).startswith(("http://", "https://")) else \
            f"mlflow ui --backend-store-uri {result['tracking_uri']}, then open "
        out.print(f"MLflow UI:     {ui}{result['mlflow_url']}")
    out.print(f"checkpoint:    {result['stages'][-1]['checkpoint'] if result['stages'] else '-'}")
    if result.get("learning_curve"):
        out.print(f"learning curve: {result['learning_curve']} (held-out success vs env steps and minutes of running)")
    out.print("turns table:   python -c \"import pandas as pd; from agentgym.store.schema import dataset_schema; "
              f"print(pd.read_parquet('{result['store']}/turns', schema=dataset_schema('turns')))\"  "
              "(columns: docs/datasets.md)")


@models_app.command("prepare")
def models_prepare(name: str = typer.Argument(..., help="'smollm2' or 'tiny'"),
                   cache_dir: str = typer.Option("~/.cache/agentgym/models", help="Cache folder.")) -> None:
    """Build or convert a model into the local cache and print its folder."""
    from agentgym.models.folders import resolve_model

    try:
        path = resolve_model(name, cache_dir)
    except (ValueError, FileNotFoundError) as e:
        console.print(str(e), style="red", markup=False)
        raise typer.Exit(2) from None
    print(path)


@config_app.command("docs")
def config_docs() -> None:
    """Print the configuration reference (docs/configuration.md) generated from the models."""
    from agentgym.config_docs import config_markdown

    print(config_markdown(), end="")


@config_app.command("check")
def config_check(config: Path = typer.Argument(..., help="YAML config to validate."),
                 set_: list[str] = typer.Option([], "--set", help="Override a field.")) -> None:
    """Validate a config file; print the resolved stages or the errors."""
    from agentgym.config import ConfigError, load_config

    try:
        cfg = load_config(config, set_)
    except ConfigError as e:
        console.print(str(e), style="red", markup=False)
        raise typer.Exit(2) from None
    print("ok:", ", ".join(f"stage {i}: horizon {s.horizon} x {s.iterations}" for i, s in enumerate(cfg.stages)))


@env_app.command("serve")
def env_serve(name: str = typer.Argument(..., help="Environment adapter name, e.g. babyai."),
              host: str = typer.Option("127.0.0.1"), port: int = typer.Option(8001),
              max_envs: int = typer.Option(64, help="Concurrent environments allowed."),
              idle_timeout: float = typer.Option(600, help="Seconds before an unused environment is closed."),
              max_body_bytes: int = typer.Option(1 << 20, help="Largest request body; beyond: HTTP 413."),
              request_timeout: float = typer.Option(
                  30, help="Seconds to receive a request's head, and its body; beyond: HTTP 408."),
              max_connections: int = typer.Option(512, help="Open connections; beyond: HTTP 503."),
              dialect: str = typer.Option(
                  "native", help="Answer in this dialect by default: native (the environment's own "
                  "AgentGym server's, so AgentGym's clients work unchanged), agentgym, babyai, textcraft, "
                  "sciworld or deepsearch. A request's X-AgentGym-Dialect header overrides it.")) -> None:
    """Expose an in-process environment over HTTP as AgentGym's environment servers do (on
    127.0.0.1 unless --host says otherwise: it runs whatever its clients send)."""
    from env_adapters import ADAPTERS, is_known
    from env_adapters.http_server import serve
    from env_adapters.http_server_dialects import DIALECTS

    if not is_known(name) or name == "http":
        console.print(f"unknown environment {name!r}; serve one of {sorted(set(ADAPTERS) - {'http'})} "
                      "or an adapter's import path (package.module:Class)", style="red", markup=False)
        raise typer.Exit(2)
    if not 0 < port < 65536:
        console.print(f"--port {port}: give a TCP port between 1 and 65535", style="red", markup=False)
        raise typer.Exit(2)
    if dialect != "native" and dialect not in DIALECTS:
        console.print(f"--dialect {dialect}: choose native or one of {sorted(DIALECTS)}", style="red", markup=False)
        raise typer.Exit(2)
    serve(name, host=host, port=port, max_envs=max_envs, idle_timeout_s=idle_timeout, dialect=dialect,
          max_body_bytes=max_body_bytes, request_timeout_s=request_timeout, max_connections=max_connections)


@env_app.command("check")
def env_check(name: str = typer.Argument(..., help="Adapter name (babyai) or import path (my_pkg.envs:MyEnv)."),
              task: list[int] = typer.Option([0, 1, 2], "--task", help="Task id to check (repeat it)."),
              horizon: int = typer.Option(5, help="Scripted steps per run."),
              kwargs: str = typer.Option("{}", help="Adapter keyword arguments as YAML/JSON, e.g. '{step_limit: 3}'."),
              truncate_at: Optional[int] = typer.Option(None, help="The step at which the adapter's own move "
                                                         "limit truncates (none: it must never truncate).")) -> None:
    """Run the conformance checker (env_adapters/checker.py) on an adapter: yours before a config uses it."""
    import yaml

    from env_adapters import is_known
    from env_adapters.checker import check_adapter

    if not is_known(name):
        console.print(f"unknown environment {name!r}; give a registered name or an import path "
                      "(package.module:Class)", style="red", markup=False)
        raise typer.Exit(2)
    env_kwargs = yaml.safe_load(kwargs) or {}
    if not isinstance(env_kwargs, dict):
        console.print(f"--kwargs {kwargs!r} must be a mapping", style="red", markup=False)
        raise typer.Exit(2)
    try:
        report = check_adapter(name, task, horizon=horizon, kwargs=env_kwargs, truncate_at=truncate_at)
    except Exception as e:  # noqa: BLE001 - an assertion names the violation; anything else the adapter raised
        console.print(f"{name}: FAILED: {type(e).__name__}: {e}", style="red", markup=False, soft_wrap=True)
        raise typer.Exit(1) from None
    print(f"{name}: ok ({report['steps']} steps over tasks {list(task)}, {report['ms_per_step']:.2f} ms/step, "
          f"{report['ms_per_reset']:.2f} ms/reset, longest observation {report['max_obs_chars']} chars)")


if __name__ == "__main__":
    app()
