"""The pure parts of ``bench/time_to_success.py``: the horizon schedule every arm follows, the
held-out points an arm's record holds, the comparison of two arms on one seed, the ratio of
training times with a bootstrap interval over seeds, and the report over the committed records.

Nothing here imports torch, TRL or the project's trainer (tests/bench/test_time_to_success.py
runs it on synthetic records). Records are ``bench/results/time_to_success-[<tag>-]<arm>-s<seed>
[-smoke].json`` (``results_io``); their ``results`` hold ``kind: "arm"``, ``arm``, ``seed``,
``tag``, ``smoke`` and the held-out ``points``.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "learning"))  # bootstrap.py
import bootstrap  # noqa: E402

BENCH = "time_to_success"
OURS = "ours"
#: the TRL arm of each comparison, and what the comparison isolates
COMPARISONS = {
    "trl-choose": "(a) same decoding: TRL's trainer, its rollout_func playing episodes with this project's "
                  "HFEngine.choose (KV cache kept across turns)",
    "trl-env": "(b) each as a user runs it: TRL's environment_factory tool loop with free-text replies",
}
ARMS = (OURS, *COMPARISONS)


# ----------------------------------------------------------------------------- the schedule


def stage_ends(stages: list[dict[str, int]]) -> list[int]:
    """Cumulative iteration count at the end of each stage (the held-out points)."""
    out, n = [], 0
    for s in stages:
        n += int(s["iterations"])
        out.append(n)
    return out


def horizon_at(stages: list[dict[str, int]], iteration: int) -> int:
    """The horizon of 0-based ``iteration`` under ``stages`` (``agentgym.schedule.position``'s
    rule; past the last stage, its horizon)."""
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    start = 0
    for s in stages:
        start += int(s["iterations"])
        if iteration < start:
            return int(s["horizon"])
    return int(stages[-1]["horizon"])


# ----------------------------------------------------------------------------- points and one seed


@dataclass
class Point:
    """One held-out evaluation of an arm: the policy after ``iterations`` iterations
    (``episodes`` played, ``optimizer_steps`` taken), ``train_s`` seconds of training wall time
    (``rollout_s`` of it playing episodes, ``update_s`` in the trainer's step), its greedy
    success on the held-out tasks and the per-task successes (in the held-out tasks' order)."""

    label: str
    iterations: int
    episodes: int
    train_s: float
    success: float
    optimizer_steps: int = 0
    rollout_s: float = 0.0
    update_s: float = 0.0
    tasks: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, d: dict[str, Any]) -> "Point":
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


def time_to_reach(points: list[Point], target: float) -> float | None:
    """Training seconds at the first held-out point at or above ``target`` (None: never)."""
    return next((p.train_s for p in points if p.success >= target - 1e-9), None)


@dataclass
class SeedComparison:
    """Ours against one TRL arm on one seed. ``target``: the lower of the two final held-out
    successes (the level both reached); each arm's time to reach it; ``ratio`` = ours / TRL.
    ``informative`` is False when the target does not exceed the base model's success (both
    'reach' it before training: the ratio says nothing about speed)."""

    seed: int
    base: float
    final_ours: float
    final_trl: float
    target: float
    t_ours: float
    t_trl: float
    informative: bool

    @property
    def ratio(self) -> float:
        return self.t_ours / self.t_trl if self.t_trl > 0 else float("nan")


def compare_seed(seed: int, ours: list[Point], trl: list[Point]) -> SeedComparison:
    """``ours`` and ``trl``: each arm's points, base first, final last (one evaluator scored both)."""
    base = ours[0].success
    target = min(ours[-1].success, trl[-1].success)
    t_ours, t_trl = time_to_reach(ours, target), time_to_reach(trl, target)
    assert t_ours is not None and t_trl is not None  # each reaches its own final success
    return SeedComparison(seed, base, ours[-1].success, trl[-1].success, target, t_ours, t_trl,
                          informative=target > max(base, trl[0].success) + 1e-9)


def ratio_interval(t_ours: list[float], t_trl: list[float], *, draws: int = 10_000, level: float = 0.95,
                   seed: int = 0) -> tuple[float, float, float]:
    """Sum of ours' times over the sum of TRL's (the ratio of mean times) and its percentile
    bootstrap interval, resampling the seeds (each seed's pair of times together: its target is
    shared). With n seeds there are only C(2n-1, n) distinct resamples: 3 seeds give 10."""
    a, b = np.asarray(t_ours, dtype=float), np.asarray(t_trl, dtype=float)
    if len(a) != len(b) or not len(a):
        raise ValueError(f"need the same non-zero number of seeds per arm, got {len(a)} and {len(b)}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a), size=(draws, len(a)))
    den = b[idx].sum(axis=1)
    ratios = np.where(den > 0, a[idx].sum(axis=1) / np.where(den > 0, den, 1.0), np.nan)
    ratios = ratios[np.isfinite(ratios)]
    point = float(a.sum() / b.sum()) if b.sum() > 0 else float("nan")
    if not len(ratios):
        return point, float("nan"), float("nan")
    return (point, *bootstrap._interval(ratios, level))


# ----------------------------------------------------------------------------- records


def record_tag(tag: str, arm: str, seed: int, smoke: bool) -> str:
    """The ``results_io`` tag of an arm's record: ``[<tag>-]<arm>-s<seed>[-smoke]``."""
    return "-".join(([tag] if tag else []) + [arm, f"s{seed}"] + (["smoke"] if smoke else []))


def load_records(folder: Path, tag: str, smoke: bool) -> dict[str, dict[int, dict[str, Any]]]:
    """``{arm: {seed: results}}`` of the arm records with this ``tag`` and ``smoke`` in ``folder``."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for path in sorted(folder.glob(f"{BENCH}-*.json")):
        try:
            res = json.loads(path.read_text()).get("results") or {}
        except (OSError, ValueError):
            continue
        if res.get("kind") != "arm" or res.get("tag", "") != tag or bool(res.get("smoke")) != smoke:
            continue
        out.setdefault(res["arm"], {})[int(res["seed"])] = res
    return out


def points_of(res: dict[str, Any]) -> list[Point]:
    return [Point.of(p) for p in res["points"]]


def _mean(xs: list[float]) -> float:
    return float(np.mean(xs)) if xs else float("nan")


def comparison(records: dict[str, dict[int, dict[str, Any]]], trl_arm: str) -> dict[str, Any] | None:
    """Ours against ``trl_arm`` over the seeds both have: per seed the finals, the target, each
    arm's time to it; the ratio of times with its interval (informative seeds only); the final
    held-out difference (ours - TRL) with its bootstrap interval over tasks and seeds
    (``bootstrap.paired_difference``); per arm the means of optimizer steps, episodes, rollout
    and update seconds. None when no seed has both arms."""
    ours, trl = records.get(OURS, {}), records.get(trl_arm, {})
    seeds = sorted(set(ours) & set(trl))
    if not seeds:
        return None
    per_seed = [compare_seed(s, points_of(ours[s]), points_of(trl[s])) for s in seeds]
    used = [c for c in per_seed if c.informative]
    ratio = ratio_interval([c.t_ours for c in used], [c.t_trl for c in used]) if used else None
    finals = {arm: [points_of(recs[s])[-1] for s in seeds] for arm, recs in ((OURS, ours), (trl_arm, trl))}
    diff = None
    if all(p.tasks for ps in finals.values() for p in ps):
        diff = bootstrap.paired_difference(np.array([p.tasks for p in finals[OURS]]),
                                           np.array([p.tasks for p in finals[trl_arm]]))
    arms = {arm: {"final_success": _mean([p.success for p in ps]), "train_s": _mean([p.train_s for p in ps]),
                  "optimizer_steps": _mean([p.optimizer_steps for p in ps]),
                  "episodes": _mean([p.episodes for p in ps]), "rollout_s": _mean([p.rollout_s for p in ps]),
                  "update_s": _mean([p.update_s for p in ps])} for arm, ps in finals.items()}
    return {"trl_arm": trl_arm, "what": COMPARISONS.get(trl_arm, ""), "seeds": seeds,
            "per_seed": [{**asdict(c), "ratio": c.ratio} for c in per_seed],
            "informative_seeds": [c.seed for c in used], "ratio": ratio, "final_difference": diff, "arms": arms}


def verdict(c: dict[str, Any]) -> str:
    """One sentence on the ratio, whichever way it comes out."""
    trl = c["trl_arm"]
    if c["ratio"] is None:
        return (f"ours vs {trl}: no seed's common target exceeds the base model's held-out success, so there "
                "is no time-to-success ratio (on every seed at least one arm ended at or below the base model)")
    r, lo, hi = c["ratio"]
    n = len(c["informative_seeds"])
    if math.isnan(lo):
        where = "no interval"
    elif hi < 1:
        where = "ours faster: the interval lies below 1"
    elif lo > 1:
        where = f"{trl} faster: the interval lies above 1"
    else:
        where = "the interval contains 1: no difference shown"
    return (f"ours vs {trl}: ours needed {r:.3f}x {trl}'s training time to reach the common target "
            f"(95 % bootstrap interval over {n} seed(s) [{lo:.3f}, {hi:.3f}]; {where})")


def report_lines(comparisons: list[dict[str, Any]], records: dict[str, dict[int, dict[str, Any]]]) -> list[str]:
    """Markdown: per comparison, a row per arm and seed, then the ratio and the verdict."""
    lines: list[str] = []
    for c in comparisons:
        trl = c["trl_arm"]
        lines += ["", f"### ours vs {trl} -- {c['what']}", "",
                  "| arm | seed | base | final held-out | target | time to target s | training s | "
                  "optimizer steps | episodes | rollout s | update s |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for s in c["per_seed"]:
            for arm, t in ((OURS, s["t_ours"]), (trl, s["t_trl"])):
                fin = points_of(records[arm][s["seed"]])[-1]
                lines.append(f"| {arm} | {s['seed']} | {s['base']:.3f} | {fin.success:.3f} | {s['target']:.3f} | "
                             f"{t:.0f} | {fin.train_s:.0f} | {fin.optimizer_steps} | {fin.episodes} | "
                             f"{fin.rollout_s:.0f} | {fin.update_s:.0f} |")
        lines.append("")
        for s in c["per_seed"]:
            if not s["informative"]:
                lines.append(f"- seed {s['seed']}: the common target {s['target']:.3f} does not exceed the base "
                             f"({s['base']:.3f}): left out of the ratio")
            else:
                lines.append(f"- seed {s['seed']}: ours {s['t_ours']:.0f} s vs {trl} {s['t_trl']:.0f} s to "
                             f"{s['target']:.3f}: ratio {s['ratio']:.3f}")
        if c["final_difference"] is not None:
            d, lo, hi = c["final_difference"]
            lines.append(f"- final held-out success, ours - {trl}: {d:+.3f} [{lo:+.3f}, {hi:+.3f}] (95 % bootstrap "
                         "over tasks, paired, and seeds)")
        lines.append(f"- **{verdict(c)}**")
    return lines
