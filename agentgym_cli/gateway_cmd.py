"""`agentgym gateway serve`: the policy of a config as an OpenAI-compatible endpoint per episode.

Registered in ``agentgym_cli/cli.py`` with ``app.add_typer(gateway_app, name="gateway")``:

    agentgym gateway serve -c configs/quickstart.yaml --port 8100
    # then, in any agent:  OpenAI(base_url="http://127.0.0.1:8100/episodes/<episode_id>/v1", api_key="-")

Each episode id names one conversation (``agentgym.gateway``: token-in/token-out, edited
histories as new context segments); ``POST /episodes/<id>/reward {"reward": r}`` scores it and
``POST /episodes/<id>/end`` ends it, after which it goes to the config's trajectory store under
``--run-id`` (stage 0, one iteration per ``--commit-every`` episodes, the rest at shutdown).
"""

from __future__ import annotations

import signal
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import typer

from agentgym_cli.common import console, quiet_env

def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


gateway_app = typer.Typer(no_args_is_help=True, help="Serve the policy to agents (OpenAI-compatible).")


@gateway_app.command("serve")
def gateway_serve(
    config: Path = typer.Option(..., "--config", "-c", help="YAML config: its model, rollout engine and store."),
    port: int = typer.Option(8100, help="TCP port."),
    host: str = typer.Option("127.0.0.1", help="Address to bind (loopback unless you mean otherwise)."),
    set_: list[str] = typer.Option([], "--set", help="Override a field: --set rollout.max_new_tokens=128"),
    model: Optional[str] = typer.Option(None, help="HF folder of the weights to serve (default: the config's model)."),
    run_id: Optional[str] = typer.Option(None, help="Store run id for the episodes (default: gateway-<UTC time>)."),
    horizon: Optional[int] = typer.Option(None, help="Replies per episode (default: the first stage's horizon)."),
    commit_every: int = typer.Option(16, help="Ended episodes per store commit (one iteration each)."),
    honor_sampling: bool = typer.Option(
        False, help="Use requests' temperature / top_p (serving, evaluation); by default the config's "
        "rollout.temperature / top_p apply, the distribution the trainer recomputes log-probs under."),
    log_level: str = typer.Option("info", help="uvicorn's log level."),
) -> None:
    """Serve the config's policy at http://HOST:PORT/episodes/{episode_id}/v1 (chat completions
    with tools, models), plus /episodes/{episode_id}/reward and /end; ended episodes go to the
    trajectory store."""
    quiet_env()
    if not 0 < port < 65536:
        console.print(f"--port {port}: give a TCP port between 1 and 65535", style="red", markup=False)
        raise typer.Exit(2)
    if commit_every < 1 or (horizon is not None and horizon < 1):
        console.print("--commit-every and --horizon must be at least 1", style="red", markup=False)
        raise typer.Exit(2)
    from agentgym.config import ConfigError, load_config

    try:
        cfg = load_config(config, set_)
    except ConfigError as e:
        console.print(str(e), style="red", markup=False)
        raise typer.Exit(2) from None
    from agentgym.chat import ChatFormatter
    from agentgym.gateway.recorder import Gateway, GatewaySettings
    from agentgym.gateway.server import serve
    from agentgym.gateway.store_sink import StoreSink
    from agentgym.models.folders import resolve_model
    from agentgym.rollout.engines import engine_for
    from agentgym.rollout.loop import RolloutSettings
    from agentgym.store.trajectory_store import TrajectoryStore

    run = run_id or "gateway-" + datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    weights = model or resolve_model(cfg.model.name_or_path, cfg.model.cache_dir)
    engine, tokenizer = engine_for(cfg, weights)
    settings = GatewaySettings.from_rollout(
        RolloutSettings.from_config(cfg, horizon or cfg.stages[0].horizon, seed=cfg.seed),
        model_name=cfg.model.name_or_path)
    settings.honor_sampling = honor_sampling
    sink = StoreSink(TrajectoryStore(cfg.store.root, run, cfg.store.storage_options), commit_every,
                     cfg.store.chunk_episodes)
    gateway = Gateway(engine, ChatFormatter(tokenizer, cfg.rollout.response_prefix), settings,
                      open_episodes=True, on_end=sink.add)
    console.print(f"serving {cfg.model.name_or_path} at http://{host}:{port}/episodes/<episode_id>/v1; "
                  f"ended episodes go to {cfg.store.root}/{run}", markup=False, soft_wrap=True)
    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then re-raises the signal: as an
    # exception here, so the episodes since the last commit are committed before the exit
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve(gateway, host=host, port=port, log_level=log_level)
    except KeyboardInterrupt:
        pass
    finally:
        gateway.close()
        sink.close()
        engine.close()
        for iteration, rows in sink.committed:
            console.print(f"committed {rows} episodes as stage 0 iteration {iteration} of run {run}", markup=False)
