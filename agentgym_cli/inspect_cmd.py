"""`agentgym inspect RUN` and `agentgym view RUN -o run.html`: look at a run's trajectories.

Registered in ``agentgym_cli/cli.py`` (``app.command("inspect")(inspect_cmd)``); the reading is
``agentgym.evaluation.inspect_run``, the page ``agentgym.evaluation.viewer``. Neither needs Prefect, MLflow or a model,
so both start fast and work on a copy of the store alone.

    agentgym inspect <run_id>                      # per-iteration table + the newest episodes
    agentgym inspect <run_id> --failed --env babyai --stage 1
    agentgym inspect trajectories/<run_id> --episode <episode_id>   # replay one episode
    agentgym view <run_id> -o run.html             # one offline HTML file to browse it
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from agentgym_cli.common import console


def _cell(v: Any) -> Text:
    """A table cell as plain text (never Rich markup: observations may contain '[...]')."""
    if isinstance(v, bool):
        return Text("yes" if v else "no")
    if isinstance(v, float):
        return Text("-" if not math.isfinite(v) else f"{v:.3f}")
    return Text("-" if v is None else str(v))


def _open(run: str, root: Optional[str]):
    from agentgym.evaluation.inspect_run import open_store

    try:
        return open_store(run, root)
    except ValueError as e:
        console.print(str(e), style="red", markup=False, soft_wrap=True)
        raise typer.Exit(2) from None


def inspect_cmd(
    run: str = typer.Argument(..., help="Run id (under --root) or the run's folder (path or s3://...)."),
    root: Optional[str] = typer.Option(None, "--root", help="Store root holding run ids [./trajectories]."),
    episode: Optional[str] = typer.Option(None, "--episode", help="Replay this episode turn by turn."),
    failed: bool = typer.Option(False, "--failed", help="List only episodes that did not succeed."),
    env: Optional[str] = typer.Option(None, "--env", help="List only this environment's episodes."),
    stage: Optional[int] = typer.Option(None, "--stage", help="List only this stage's episodes."),
    limit: int = typer.Option(20, "--limit", help="Episodes listed (newest iterations first)."),
) -> None:
    """Per-iteration numbers of a run and its newest episodes, or one episode's turns."""
    from agentgym.evaluation.inspect_run import episode_turns, iteration_table, list_episodes

    store = _open(run, root)
    out = Console(soft_wrap=True, highlight=False)
    if episode is not None:
        try:
            ep, turns = episode_turns(store, episode)
        except KeyError as e:
            console.print(str(e.args[0]), style="red", markup=False, soft_wrap=True)
            raise typer.Exit(2) from None
        _replay(out, ep, turns)
        return

    table = Table(title=f"run {store.run_id}: committed iterations")
    cols = [("stage", "stage"), ("iteration", "iter"), ("policy_version", "policy"),
            ("horizon", "horizon"), ("episodes", "episodes"), ("infra_errors", "infra err"),
            ("success_rate", "success"), ("reward_mean", "reward"), ("turns_mean", "turns"),
            ("format_error_rate", "format err"), ("invalid_action_rate", "invalid act")]
    for _, name in cols:
        table.add_column(name, justify="right")
    for r in iteration_table(store):
        table.add_row(*(_cell(r[k]) for k, _ in cols))
    out.print(table)

    eps = list_episodes(store, failed_only=failed, env=env, stage=stage)
    shown = eps[: max(limit, 0)]
    what = ", ".join(x for x in (("failed" if failed else ""), (f"env {env}" if env else ""),
                                 (f"stage {stage}" if stage is not None else "")) if x)
    lst = Table(title=f"episodes{' (' + what + ')' if what else ''}: {len(shown)} of {len(eps)}, "
                      "newest first")
    for name in ("episode", "env", "task", "stage", "iter", "reward", "success", "turns"):
        lst.add_column(name, justify="left" if name in ("episode", "env") else "right")
    for e in shown:
        ok = "infra error" if e["infra_error"] else e["success"]
        lst.add_row(*(_cell(v) for v in (e["episode_id"], e["env"], e["task_id"], e["stage"],
                                          e["iteration"], e["reward"], ok, e["num_turns"])))
    out.print(lst)
    if shown:
        out.print(Text(f"replay one: agentgym inspect {run} --episode {shown[0]['episode_id']}"
                       + (f" --root {root}" if root else "")))


def _replay(out: Console, ep: dict, turns: list[dict]) -> None:
    out.print(Text(f"episode {ep['episode_id']}  env {ep['env']}  task {ep['task_id']}  "
                   f"seed {ep['seed']}  stage {ep['stage']} iteration {ep['iteration']}  "
                   f"horizon {ep['horizon']}  policy version {ep['policy_version']}"))
    status = "success" if ep["success"] else "not solved"
    out.print(Text(f"reward {_cell(ep['reward'])}  {status}  {ep['num_turns']} turns"
                   + ("  terminated" if ep["terminated"] else "")
                   + ("  truncated" if ep["truncated"] else "")))
    if ep["infra_error"]:
        out.print(Text(f"infra error: {ep['error']}", style="yellow"))
    for t in turns:
        flags = [f for f, on in (("FORMAT ERROR", t["format_error"]),
                                 ("INVALID ACTION", t["invalid_action"])) if on]
        out.print(Rule(Text(f"turn {t['turn']}  reward {_cell(t['reward'])}"
                            + "".join(f"  {f}" for f in flags)), align="left"))
        out.print(Text("observation:", style="bold"))
        out.print(Text(t["observation"]))
        out.print(Text("reply:", style="bold"))
        out.print(Text(t["action_text"]))
        out.print(Text(f"parsed action: {t['parsed_action'] if t['parsed_action'] is not None else '(none)'}"))


def view_cmd(
    run: str = typer.Argument(..., help="Run id (under --root) or the run's folder (path or s3://...)."),
    output: Path = typer.Option(Path("run.html"), "--output", "-o", help="HTML file to write."),
    root: Optional[str] = typer.Option(None, "--root", help="Store root holding run ids [./trajectories]."),
    max_episodes: int = typer.Option(5000, "--max-episodes",
                                     help="Episodes embedded, newest iterations first (bounds the file size)."),
) -> None:
    """Write one self-contained HTML file (no network needed) to browse a run's episodes."""
    from agentgym.evaluation.viewer import write_html

    store = _open(run, root)
    got = write_html(store, output, max_episodes)
    omitted = f" ({got['omitted_episodes']} older ones left out: --max-episodes)" if got["omitted_episodes"] else ""
    print(f"wrote {output}: {got['bytes'] / 1e6:.2f} MB, {got['episodes']} episodes{omitted}")
