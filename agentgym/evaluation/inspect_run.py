"""Read a finished (or running) run's trajectory store for people: per-iteration numbers, episode
lists, one episode's turns. Pure functions over ``TrajectoryStore``; the command line
(``agentgym inspect``) and the HTML viewer (``agentgym.evaluation.viewer``) only format what these return.

The numbers follow ``agentgym.pipeline.episode_metrics`` (what MLflow shows for the same
iteration): infra-error episodes (reward NaN, never scored) are counted in ``infra_errors`` and
left out of every mean and rate, including the per-turn rates over their turns.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, NamedTuple

import pyarrow as pa

from agentgym.store.trajectory_store import TrajectoryStore

__all__ = [
    "DEFAULT_ROOT",
    "EPISODE_COLUMNS",
    "EPISODE_ID_FORMS",
    "ITERATION_COLUMNS",
    "TURN_COLUMNS",
    "Column",
    "episode_id_parts",
    "episode_turns",
    "iteration_table",
    "list_episodes",
    "open_store",
]

DEFAULT_ROOT = "./trajectories"

# What a person looks at: the ``episodes`` table minus the token columns (input_ids, loss_mask,
# old_logprobs), which are long and unreadable, and the bookkeeping columns.
EPISODE_COLUMNS = [
    "episode_id", "group_id", "env", "task_id", "seed", "horizon", "stage", "iteration",
    "num_turns", "reward", "success", "terminated", "truncated", "infra_error", "error",
    "policy_version",
]
TURN_COLUMNS = [
    "turn", "observation", "action_text", "parsed_action", "reward", "terminated", "truncated",
    "format_error", "invalid_action", "gen_tokens", "env_latency_ms",
]



class Column(NamedTuple):
    """One column of ``iteration_table`` as people see it: its key, its header (``agentgym
    inspect``'s wide table and the viewer), a short header (``inspect``'s compact table) and what
    it means (the compact table's key, the viewer's header tooltip)."""

    key: str
    name: str
    short: str
    help: str


ITERATION_COLUMNS = [
    Column("stage", "stage", "st", "stage of the ScalingInter-RL schedule"),
    Column("iteration", "iter", "it", "iteration within the stage"),
    Column("policy_version", "policy", "pol", "policy version that played (updates so far)"),
    Column("horizon", "horizon", "hor", "turns an episode may take in this stage"),
    Column("episodes", "episodes", "eps", "episodes played"),
    Column("infra_errors", "infra err", "inf", "episodes lost to infrastructure errors (not scored)"),
    Column("success_rate", "success", "succ", "share of scored episodes solved"),
    Column("reward_mean", "reward", "rew", "mean episode reward"),
    Column("turns_mean", "turns", "turns", "mean turns per episode"),
    Column("format_error_rate", "format err", "fmt", "share of turns whose reply had no valid action line"),
    Column("invalid_action_rate", "invalid act", "inv", "share of turns the environment refused the action"),
]

# How episode ids are made (``agentgym.pipeline.plan_episodes``; demonstrations:
# ``agentgym.training.demos``): each form, the pattern its parts are read with, and what they mean.
_PIPELINE_ID = re.compile(r"s(?P<step>\d+)-g(?P<group>\d+)-(?P<env>.+)-(?P<task>\d+)"
                          r"(?:-d(?P<draw>\d+))?-e(?P<sample>\d+)")
_DEMO_ID = re.compile(r"demo-(?P<attempt>\d+)-(?P<env>.+)-(?P<task>\d+)-s(?P<seed>\d+)")

#: (form, example, meaning) of each kind of episode id, for legends
EPISODE_ID_FORMS = [
    ("s<global step>-g<group>-<env>-<task>[-d<draw>]-e<sample>", "s23-g3-babyai-124-e0",
     "global step 23 (the RL iteration counted from the run's start, across stages), group 3 of "
     "that step (one task played group_size times from the same start: the samples GRPO/RLOO "
     "compare), environment babyai, task 124, sample 0 of its group; -d<draw> marks a further "
     "draw of dynamic sampling (rollout.max_draws), which replaced groups that tied"),
    ("demo-<attempt>-<env>-<task>-s<seed>", "demo-000012-babyai-5-s1012",
     "an SFT demonstration by the scripted expert: attempt 12, environment babyai, task 5, "
     "reset seed 1012"),
]

_PART_NAMES = {"step": "global step", "group": "group", "env": "env", "task": "task",
               "draw": "draw", "sample": "sample", "attempt": "attempt", "seed": "seed"}


def episode_id_parts(episode_id: str) -> list[tuple[str, str]] | None:
    """The parts of a pipeline or demonstration episode id, named (``EPISODE_ID_FORMS``), e.g.
    ``[("global step", "23"), ("group", "3"), ("env", "babyai"), ("task", "124"),
    ("sample", "0")]``; None for an id of another form."""
    for pattern in (_PIPELINE_ID, _DEMO_ID):
        m = pattern.fullmatch(episode_id)
        if m:
            return [(_PART_NAMES[k], v if k == "env" else str(int(v)))
                    for k, v in m.groupdict().items() if v is not None]
    return None


def open_store(target: str, root: str | None = None,
               storage_options: dict | None = None) -> TrajectoryStore:
    """The store of one run. ``target`` is a run id under ``root`` (default ``./trajectories``)
    or the run's own folder (a local path, or ``s3://bucket/prefix/run_id``).

    A run counts as present when it has at least one committed ``episodes`` iteration (a folder
    without commits holds nothing a reader trusts). Raises ``ValueError`` naming every place
    tried when none holds one.
    """
    candidates: list[tuple[str, str]] = []
    if "://" in target:
        parent, _, name = target.rstrip("/").rpartition("/")
        candidates.append((parent, name))
    else:
        if os.sep in target or "/" in target or os.path.isdir(target):
            path = os.path.abspath(target.rstrip("/"))
            candidates.append((os.path.dirname(path), os.path.basename(path)))
        if "/" not in target:
            candidates.append((root or DEFAULT_ROOT, target))
    tried: list[str] = []
    for parent, name in candidates:
        where = f"{parent.rstrip('/')}/{name}"
        tried.append(where)
        try:
            store = TrajectoryStore(parent, name, storage_options)
            if store.commits("episodes"):
                return store
        except ValueError:  # not a valid run id (empty, leading '.' or '_')
            continue
        except OSError as e:  # unreachable bucket, no permission: say so with the place
            tried[-1] = f"{where} ({type(e).__name__}: {e})"
    raise ValueError(f"no run with committed episodes at {' or '.join(tried) or repr(target)}")


def _finite(x: float | None) -> bool:
    return x is not None and not math.isnan(x)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def iteration_table(store: TrajectoryStore) -> list[dict[str, Any]]:
    """One row per committed (stage, iteration) of ``episodes``, in order.

    Keys: stage, iteration, policy_version, episodes, infra_errors, success_rate, reward_mean,
    turns_mean, format_error_rate, invalid_action_rate (over the turns of scored episodes),
    horizon (the longest horizon among the iteration's episodes; one value in a pipeline run).
    A mean over nothing is NaN. Demonstration sets (``demos-<hash>``, policy_version -1) read
    the same way.
    """
    eps = store.read_arrow("episodes", columns=[
        "stage", "iteration", "episode_id", "horizon", "num_turns", "reward", "success",
        "infra_error", "policy_version"]).to_pylist()
    turns = store.read_arrow("turns", columns=[
        "stage", "iteration", "episode_id", "format_error", "invalid_action"]).to_pylist()
    infra = {(e["stage"], e["iteration"], e["episode_id"]) for e in eps if e["infra_error"]}
    by_key: dict[tuple[int, int], list[dict]] = {}
    for e in eps:
        by_key.setdefault((e["stage"], e["iteration"]), []).append(e)
    turns_by_key: dict[tuple[int, int], list[dict]] = {}
    for t in turns:
        if (t["stage"], t["iteration"], t["episode_id"]) not in infra:
            turns_by_key.setdefault((t["stage"], t["iteration"]), []).append(t)
    rows = []
    for key in sorted(by_key):
        group = by_key[key]
        ok = [e for e in group if not e["infra_error"]]
        tt = turns_by_key.get(key, [])
        rows.append({
            "stage": key[0],
            "iteration": key[1],
            "policy_version": max(e["policy_version"] for e in group),
            "episodes": len(group),
            "infra_errors": len(group) - len(ok),
            "success_rate": _mean([float(e["success"]) for e in ok]),
            "reward_mean": _mean([e["reward"] for e in ok if _finite(e["reward"])]),
            "turns_mean": _mean([float(e["num_turns"]) for e in ok]),
            "format_error_rate": _mean([float(t["format_error"]) for t in tt]),
            "invalid_action_rate": _mean([float(t["invalid_action"]) for t in tt]),
            "horizon": max(e["horizon"] for e in group),
        })
    return rows


def list_episodes(store: TrajectoryStore, *, failed_only: bool = False, env: str | None = None,
                  stage: int | None = None, iteration: int | None = None,
                  limit: int | None = None) -> list[dict[str, Any]]:
    """Episodes (``EPISODE_COLUMNS``) matching every given filter, newest iteration first and in
    written order within one; at most ``limit`` of them.

    ``failed_only`` keeps episodes that did not succeed, infra errors included (a person looking
    for what went wrong wants both).
    """
    t: pa.Table = store.read_arrow("episodes", stage=stage, iteration=iteration,
                                   columns=EPISODE_COLUMNS)
    rows = t.to_pylist()
    for pos, r in enumerate(rows):
        r["_pos"] = pos
    if env is not None:
        rows = [r for r in rows if r["env"] == env]
    if failed_only:
        rows = [r for r in rows if not r["success"]]
    rows.sort(key=lambda r: (-r["stage"], -r["iteration"], r["_pos"]))
    for r in rows:
        del r["_pos"]
    return rows if limit is None else rows[: max(int(limit), 0)]


def episode_turns(store: TrajectoryStore,
                  episode_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One episode (``EPISODE_COLUMNS``) and its turns (``TURN_COLUMNS``, by turn number).

    Ids are unique within a run; if a hand-edited store repeats one, the newest iteration wins.
    Raises ``KeyError`` when the run has no such episode.
    """
    eps = list_episodes(store)
    match = next((e for e in eps if e["episode_id"] == episode_id), None)
    if match is None:
        raise KeyError(f"no episode {episode_id!r} in run {store.run_id!r}")
    t = store.read_arrow("turns", stage=match["stage"], iteration=match["iteration"],
                         columns=["episode_id", *TURN_COLUMNS])
    turns = [r for r in t.to_pylist() if r.pop("episode_id") == episode_id]
    turns.sort(key=lambda r: r["turn"])
    return match, turns
