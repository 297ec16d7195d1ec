"""`agentgym inspect RUN` and `agentgym view RUN -o run.html`: look at a run's trajectories.

Registered in ``agentgym_cli/cli.py`` (``app.command("inspect")(inspect_cmd)``); the reading is
``agentgym.evaluation.inspect_run``, the page ``agentgym.evaluation.viewer``. Neither needs Prefect, MLflow or a model,
so both start fast and work on a copy of the store alone.

    agentgym inspect <run_id>                      # per-iteration table + the newest episodes
    agentgym inspect <run_id> --failed --env babyai --stage 1
    agentgym inspect trajectories/<run_id> --episode <episode_id>   # replay one episode
    agentgym view <run_id> -o run.html             # one offline HTML file to browse it

Two layouts: wide (every header in full) and compact (short headers explained in a key under
the table, no vertical rules, our lines wrapped to the terminal or 80 columns, the narrower). By default
the compact one is used when the wide iteration table is wider than the terminal (``COLUMNS``,
else the terminal's size); ``--compact`` / ``--wide`` choose. Either way a number is never cut:
a column too narrow folds its value onto a second line rather than end it with "...". Numbers
are written by ``agentgym.evaluation.numbers.fmt_num``, the viewer's rule.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Optional

import typer
from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from agentgym.evaluation.numbers import fmt_num  # stdlib only: loads nothing heavy
from agentgym_cli.common import console


def _cell(v: Any) -> Text:
    """A table cell as plain text (never Rich markup: observations may contain '[...]')."""
    if isinstance(v, bool):
        return Text("yes" if v else "no")
    return Text(fmt_num(v))


def _open(run: str, root: Optional[str]):
    from agentgym.evaluation.inspect_run import open_store

    try:
        return open_store(run, root)
    except ValueError as e:
        console.print(str(e), style="red", markup=False, soft_wrap=True)
        raise typer.Exit(2) from None


def _table(title: str, compact: bool) -> Table:
    if compact:  # no vertical rules, one space each side: what 80 columns leave room for
        return Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                     padding=(0, 1), collapse_padding=True)
    return Table(title=title)


def _wrapped(out: Console, text: str, style: str = "") -> None:
    """A line of ours (not the run's text) wrapped at word boundaries to the terminal's width."""
    out.print(Text(text, style=style), soft_wrap=False)


def _iteration_table(rows: list[dict], run_id: str, compact: bool) -> Table:
    from agentgym.evaluation.inspect_run import ITERATION_COLUMNS

    table = _table(f"run {run_id}: committed iterations", compact)
    for c in ITERATION_COLUMNS:
        table.add_column(c.short if compact else c.name, justify="right", no_wrap=True, overflow="fold")
    for r in rows:
        table.add_row(*(_cell(r[c.key]) for c in ITERATION_COLUMNS))
    return table


def inspect_cmd(
    run: str = typer.Argument(..., help="Run id (under --root) or the run's folder (path or s3://...)."),
    root: Optional[str] = typer.Option(None, "--root", help="Store root holding run ids [./trajectories]."),
    episode: Optional[str] = typer.Option(None, "--episode", help="Replay this episode turn by turn."),
    failed: bool = typer.Option(False, "--failed", help="List only episodes that did not succeed."),
    env: Optional[str] = typer.Option(None, "--env", help="List only this environment's episodes."),
    stage: Optional[int] = typer.Option(None, "--stage", help="List only this stage's episodes."),
    limit: int = typer.Option(20, "--limit", help="Episodes listed (newest iterations first)."),
    compact: Optional[bool] = typer.Option(
        None, "--compact/--wide",
        help="Short headers that fit 80 columns, or every header in full. Unset: compact when "
             "the wide table is wider than the terminal (COLUMNS)."),
) -> None:
    """Per-iteration numbers of a run and its newest episodes, or one episode's turns."""
    from agentgym.evaluation.inspect_run import (
        EPISODE_ID_FORMS,
        ITERATION_COLUMNS,
        episode_turns,
        iteration_table,
        list_episodes,
    )

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

    rows = iteration_table(store)
    wide = _iteration_table(rows, store.run_id, compact=False)
    if compact is None:
        # measured unclamped: Rich clamps a measurement to the width it is given
        compact = Measurement.get(out, out.options.update_width(10_000), wide).maximum > out.width
    if compact:  # at most 80 columns, even on a wider terminal (for pasting into a report)
        out = Console(soft_wrap=True, highlight=False, width=min(out.width, 80))

    if compact:
        out.print(_iteration_table(rows, store.run_id, compact=True))
        _wrapped(out, ", ".join(f"{c.short} {c.key.replace('_', ' ')}" for c in ITERATION_COLUMNS
                                if c.short != c.key), "dim")
    else:
        out.print(wide)

    eps = list_episodes(store, failed_only=failed, env=env, stage=stage)
    shown = eps[: max(limit, 0)]
    what = ", ".join(x for x in (("failed" if failed else ""), (f"env {env}" if env else ""),
                                 (f"stage {stage}" if stage is not None else "")) if x)
    lst = _table(f"episodes{' (' + what + ')' if what else ''}: {len(shown)} of {len(eps)}, "
                 "newest first", compact)
    heads = (("episode", "env", "task", "st", "it", "reward", "ok", "turns") if compact else
             ("episode", "env", "task", "stage", "iter", "reward", "success", "turns"))
    for name in heads:
        lst.add_column(name, justify="left" if name in ("episode", "env") else "right",
                       no_wrap=True, overflow="fold")
    for row in shown:
        ok = ("infra" if compact else "infra error") if row["infra_error"] else row["success"]
        lst.add_row(*(_cell(v) for v in (row["episode_id"], row["env"], row["task_id"], row["stage"],
                                          row["iteration"], row["reward"], ok, row["num_turns"])))
    out.print(lst)
    if shown:
        form, example, _ = EPISODE_ID_FORMS[0]  # the viewer's legend says more; --episode names the parts
        _wrapped(out, f"episode ids: {form}, e.g. {example}", "dim")
        words = [f"agentgym inspect {shlex.quote(run)}", f"--episode {shlex.quote(shown[0]['episode_id'])}"]
        words += [f"--root {shlex.quote(root)}"] if root else []
        if compact:
            out.print(Text("replay one:\n" + _shell_lines(words, out.width)))
        else:
            out.print(Text("replay one: " + " ".join(words)))


def _shell_lines(words: list[str], width: int) -> str:
    """A command as lines of at most ``width`` characters, continued with backslashes, so it
    still pastes into a shell as one; a single word longer than a line (a long path) is not cut."""
    lines = ["  " + words[0]]
    for w in words[1:]:
        if len(lines[-1]) + 1 + len(w) + 2 <= width:  # room for " w" and a later " \\"
            lines[-1] += " " + w
        else:
            lines.append("    " + w)
    return " \\\n".join(lines)


def _replay(out: Console, ep: dict, turns: list[dict]) -> None:
    """The header lines are ours and wrap to the terminal's width (either layout); the run's own
    text (observations, replies) is printed verbatim, each line as it was, for the terminal to
    wrap."""
    from agentgym.evaluation.inspect_run import episode_id_parts

    parts = episode_id_parts(ep["episode_id"])
    _wrapped(out, f"episode {ep['episode_id']}"
             + (f"  ({', '.join(f'{k} {v}' for k, v in parts)})" if parts else ""))
    _wrapped(out, f"env {ep['env']}  task {ep['task_id']}  seed {ep['seed']}  stage {ep['stage']} "
                  f"iteration {ep['iteration']}  horizon {ep['horizon']}  "
                  f"policy version {ep['policy_version']}")
    status = "success" if ep["success"] else "not solved"
    _wrapped(out, f"reward {_cell(ep['reward'])}  {status}  {ep['num_turns']} turns"
             + ("  terminated" if ep["terminated"] else "")
             + ("  truncated" if ep["truncated"] else ""))
    if ep["infra_error"]:
        _wrapped(out, f"infra error: {ep['error']}", "yellow")
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
