"""Held-out evaluation: Avg@k and Pass@k per environment and task category.

AgentGym-RL reports results per environment and, inside an environment, per task category:

* **BabyAI** -- by level family. ``data_idx`` plays level ``data_idx % 40 + 1`` of AgentGym's
  table (:data:`env_adapters.babyai.LEVELS`); the family is the minigrid module that defines the
  level's class (``minigrid/envs/babyai/{goto,open,pickup,putnext,unlock,synth,other}.py``):
  GoTo, Open, Pickup, PutNext, Unlock, Synth (Synth* and the Boss levels) and Other (ActionObjDoor,
  FindObj, KeyCorridor, OneRoom, MoveTwoAcross). ``tests/agentgym/test_evaluation.py`` checks the
  table against minigrid.
* **TextCraft** -- by the goal's minimum recipe depth, ``depth-1`` .. ``depth-4``.
* every other environment -- one category, the environment's name.

Metrics (``k`` samples per task unless ``n > k`` samples are drawn):

* ``avg@k`` -- the mean success over all samples of a task, averaged over tasks (an unbiased
  estimate of the expected success of one sample);
* ``pass@k`` -- the unbiased estimator of the Codex paper (Chen et al. 2021, eq. 1),
  ``1 - C(n-c, k) / C(n, k)`` for ``c`` successes out of ``n`` samples, averaged over tasks;
* greedy decoding is deterministic, so a greedy evaluation draws one sample (``k = n = 1``).

Episodes that hit an infrastructure fault are not scored: they are dropped from ``n`` (and
counted in ``infra_errors``). An environment's ``overall`` row averages over all its tasks; the
report's :attr:`EvalReport.score` is the mean of the environments' overall ``avg@k`` (each
environment counts once, whatever its number of tasks).

Pure library code: no Prefect, no MLflow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from agentgym.chat import ChatFormatter
from agentgym.config import EnvSpec, PipelineConfig
from agentgym.rollout.engines.base import InferenceEngine
from agentgym.rollout.loop import EpisodeSpec, RolloutSettings, run_episodes
from agentgym.types import Episode
from env_adapters import make_env as default_make_env
from env_adapters import task_category as env_task_category

OVERALL = "overall"

# -- categories ----------------------------------------------------------------------------------
def task_category(env: str, task_id: int, env_kwargs: Mapping[str, Any] | None = None) -> str:
    """The AgentGym-RL category of a task, as its adapter names it (``TextEnv.task_category``);
    a remote (``http``) environment is categorised by its ``env_name`` like the in-process one."""
    return env_task_category(env, task_id, env_kwargs)


# -- estimators ----------------------------------------------------------------------------------
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``c`` successes in ``n`` samples: ``1 - C(n-c, k) / C(n, k)``.

    Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (numerically stable, Chen et al. 2021).
    With fewer samples than ``k`` (``n < k``, e.g. after infra faults) the estimator is undefined;
    the empirical value ``c > 0`` is returned then.
    """
    if n < 0 or c < 0 or c > n or k < 1:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and k >= 1 (got n={n}, c={c}, k={k})")
    if n == 0:
        return float("nan")
    if n < k:
        return float(c > 0)
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def avg_at_k(successes: Sequence[bool | float]) -> float:
    """Avg@k of one task: the mean success over its samples (nan without samples)."""
    return float(np.mean(np.asarray(successes, dtype=float))) if len(successes) else float("nan")


# -- results -------------------------------------------------------------------------------------
@dataclass
class TaskResult:
    env: str
    task_id: int
    category: str
    n: int  # scored samples (infra faults excluded)
    successes: int
    reward_mean: float
    infra_errors: int = 0

    def avg(self) -> float:
        return self.successes / self.n if self.n else float("nan")

    def pass_k(self, k: int) -> float:
        return pass_at_k(self.n, self.successes, k)


@dataclass
class CategoryResult:
    env: str
    category: str
    tasks: int
    episodes: int
    avg_at_k: float
    pass_at_k: float
    reward_mean: float
    infra_errors: int


def aggregate(results: Sequence[TaskResult], k: int, env: str, category: str) -> CategoryResult:
    """Average the per-task estimates (tasks with no scored sample are left out)."""
    scored = [r for r in results if r.n > 0]
    nan = float("nan")
    return CategoryResult(
        env=env, category=category, tasks=len(scored), episodes=sum(r.n for r in scored),
        avg_at_k=float(np.mean([r.avg() for r in scored])) if scored else nan,
        pass_at_k=float(np.mean([r.pass_k(k) for r in scored])) if scored else nan,
        reward_mean=float(np.average([r.reward_mean for r in scored], weights=[r.n for r in scored]))
        if scored else nan,
        infra_errors=sum(r.infra_errors for r in results),
    )


@dataclass
class EvalReport:
    """Avg@k / Pass@k per (environment, category), plus each environment's ``overall`` row."""

    k: int
    n: int
    greedy: bool
    horizon: int
    seed: int
    tasks: list[TaskResult] = field(default_factory=list)
    rows: list[CategoryResult] = field(default_factory=list)

    @classmethod
    def from_tasks(cls, tasks: list[TaskResult], *, k: int, n: int, greedy: bool, horizon: int,
                   seed: int) -> "EvalReport":
        rows: list[CategoryResult] = []
        for env in dict.fromkeys(t.env for t in tasks):
            mine = [t for t in tasks if t.env == env]
            for cat in sorted({t.category for t in mine}):
                rows.append(aggregate([t for t in mine if t.category == cat], k, env, cat))
            rows.append(aggregate(mine, k, env, OVERALL))
        return cls(k=k, n=n, greedy=greedy, horizon=horizon, seed=seed, tasks=tasks, rows=rows)

    @property
    def mode(self) -> str:
        return "greedy" if self.greedy else "sampled"

    def envs(self) -> list[str]:
        return list(dict.fromkeys(r.env for r in self.rows))

    def row(self, env: str, category: str = OVERALL) -> CategoryResult:
        for r in self.rows:
            if r.env == env and r.category == category:
                return r
        raise KeyError(f"no evaluation row for env={env!r}, category={category!r}")

    @property
    def score(self) -> float:
        """Mean over environments of the overall Avg@k (nan if nothing was scored)."""
        vals = [self.row(e).avg_at_k for e in self.envs()]
        vals = [v for v in vals if math.isfinite(v)]
        return float(np.mean(vals)) if vals else float("nan")

    @property
    def score_pass(self) -> float:
        vals = [self.row(e).pass_at_k for e in self.envs()]
        vals = [v for v in vals if math.isfinite(v)]
        return float(np.mean(vals)) if vals else float("nan")

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        """Flat MLflow metrics: ``{prefix}/<env>/<category>/avg_at_<k>`` and ``.../pass_at_<k>``
        (sampled), or ``.../greedy_at_1`` (greedy); ``.../n_tasks``; ``{prefix}/overall/...`` over
        environments. (MLflow rejects ``@`` in metric names, hence ``_at_``.)"""
        out: dict[str, float] = {}
        for r in self.rows:
            base = f"{prefix}/{r.env}/{r.category}"
            if self.greedy:
                out[f"{base}/greedy_at_1"] = r.avg_at_k
            else:
                out[f"{base}/avg_at_{self.k}"] = r.avg_at_k
                out[f"{base}/pass_at_{self.k}"] = r.pass_at_k
            out[f"{base}/n_tasks"] = float(r.tasks)
        if self.greedy:
            out[f"{prefix}/overall/greedy_at_1"] = self.score
        else:
            out[f"{prefix}/overall/avg_at_{self.k}"] = self.score
            out[f"{prefix}/overall/pass_at_{self.k}"] = self.score_pass
        return out

    def table(self) -> list[dict[str, Any]]:
        """Rows for a table (Prefect artifact, console): one per (env, category)."""
        out = []
        for r in self.rows:
            row: dict[str, Any] = {"env": r.env, "category": r.category, "tasks": r.tasks,
                                   "episodes": r.episodes}
            if self.greedy:
                row["greedy@1"] = _r(r.avg_at_k)
            else:
                row[f"avg@{self.k}"] = _r(r.avg_at_k)
                row[f"pass@{self.k}"] = _r(r.pass_at_k)
            row["reward_mean"] = _r(r.reward_mean)
            row["infra_errors"] = r.infra_errors
            out.append(row)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"k": self.k, "n": self.n, "greedy": self.greedy, "horizon": self.horizon,
                "seed": self.seed, "score": self.score, "tasks": [asdict(t) for t in self.tasks],
                "rows": [asdict(r) for r in self.rows]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "EvalReport":
        return cls(k=d["k"], n=d["n"], greedy=d["greedy"], horizon=d["horizon"], seed=d["seed"],
                   tasks=[TaskResult(**t) for t in d["tasks"]],
                   rows=[CategoryResult(**r) for r in d["rows"]])


def _r(x: float) -> float | None:
    return None if not math.isfinite(x) else round(float(x), 4)


# -- evaluation ----------------------------------------------------------------------------------
@dataclass
class EvalTarget:
    """One environment to evaluate: its report label, spec (adapter + kwargs) and task ids."""

    label: str
    spec: EnvSpec
    tasks: list[int]


def eval_targets(cfg: PipelineConfig,
                 tasks_by_env: Mapping[str, Sequence[int]] | None = None) -> list[EvalTarget]:
    """The environments and held-out tasks to evaluate.

    Labels are the environment names; a name used by several ``envs`` entries (e.g. two
    ``keyword`` configurations) gets ``-2``, ``-3``... from its second entry on. ``tasks_by_env``
    maps labels to task ids and replaces the config's ``eval_tasks`` for the labels it names;
    environments without tasks are skipped.
    """
    seen: dict[str, int] = {}
    labels = []
    for e in cfg.envs:
        seen[e.name] = seen.get(e.name, 0) + 1
        labels.append(e.name if seen[e.name] == 1 else f"{e.name}-{seen[e.name]}")
    if tasks_by_env is not None:
        unknown = set(tasks_by_env) - set(labels)
        if unknown:
            raise ValueError(f"tasks_by_env names unknown environments {sorted(unknown)}; "
                             f"the config's are {labels}")
    out = []
    for label, spec in zip(labels, cfg.envs):
        tasks = tasks_by_env[label] if tasks_by_env is not None and label in tasks_by_env \
            else spec.eval_tasks
        tasks = [int(x) for x in dict.fromkeys(tasks)]  # each task once
        if tasks:
            out.append(EvalTarget(label, spec, tasks))
    return out


def evaluate(
    engine: InferenceEngine,
    formatter: ChatFormatter,
    cfg: PipelineConfig,
    tasks_by_env: Mapping[str, Sequence[int]] | None = None,
    k: int = 4,
    horizon: int | None = None,
    greedy: bool = False,
    seed: int = 0,
    *,
    n: int | None = None,
    batch_episodes: int = 64,
    make_env: Callable[..., Any] | None = None,
    on_turn: Callable[[int, int], None] | None = None,
    play: Callable[[list[EpisodeSpec], RolloutSettings], list[Episode]] | None = None,
) -> EvalReport:
    """Play ``n`` (default ``k``) episodes of every held-out task and score them.

    ``seed`` fixes everything that is random: every episode starts from the environment state
    ``reset(task, seed)`` (``seed=0`` is AgentGym's own mapping of ``data_idx``), and generation
    is seeded per batch from it -- two policies evaluated with the same config, tasks and seed
    play exactly the same task instances. ``horizon`` defaults to the schedule's last (longest)
    horizon. Episodes run in batches of about ``batch_episodes`` (whole tasks per batch).
    """
    make_env = make_env or default_make_env
    if greedy:
        k, n = 1, 1
    n = k if n is None else n
    if k < 1 or n < k:
        raise ValueError(f"evaluate needs 1 <= k <= n (got k={k}, n={n})")
    horizon = horizon or max(s.horizon for s in cfg.stages)
    targets = eval_targets(cfg, tasks_by_env)
    groups: list[list[EpisodeSpec]] = []
    category: dict[tuple[str, int], str] = {}
    for t in targets:
        for task in t.tasks:
            category[(t.label, task)] = task_category(t.spec.name, task, t.spec.kwargs)
            gid = f"eval:{t.label}:{task}"
            groups.append([EpisodeSpec(t.spec.name, task, seed, gid, f"{gid}:{j}", dict(t.spec.kwargs))
                           for j in range(n)])
    batches: list[list[EpisodeSpec]] = []
    for g in groups:
        if batches and len(batches[-1]) + len(g) <= max(batch_episodes, len(g)):
            batches[-1].extend(g)
        else:
            batches.append(list(g))
    episodes: list[Episode] = []
    for b, specs in enumerate(batches):
        settings = RolloutSettings.from_config(cfg, horizon, seed=seed * 1_000_003 + b, greedy=greedy)
        if play is not None:  # e.g. a training session's rollout workers (PolicySession.play_episodes)
            episodes.extend(play(specs, settings))
        else:
            episodes.extend(run_episodes(engine, formatter, specs, settings, make_env=make_env, on_turn=on_turn))
    label_of = {s.episode_id: s.group_id.split(":")[1] for g in groups for s in g}
    by_task: dict[tuple[str, int], list[Episode]] = {}
    for ep in episodes:
        by_task.setdefault((label_of[ep.episode_id], ep.task_id), []).append(ep)
    results = []
    for t in targets:
        for task in t.tasks:
            eps = by_task.get((t.label, task), [])
            ok = [e for e in eps if not e.infra_error]
            results.append(TaskResult(
                env=t.label, task_id=task, category=category[(t.label, task)], n=len(ok),
                successes=sum(bool(e.success) for e in ok),
                reward_mean=float(np.mean([e.reward for e in ok])) if ok else float("nan"),
                infra_errors=len(eps) - len(ok),
            ))
    return EvalReport.from_tasks(results, k=k, n=n, greedy=greedy, horizon=horizon, seed=seed)
