"""Before/after evaluation on the held-out tasks, side by side.

The pipeline scores, on every environment's ``eval_tasks`` and with the same reset seed:

* ``random-valid`` -- a uniformly random valid action each turn (the floor every success rate
  must be read against; averaged over ``heldout.random_seeds`` seeds);
* ``base`` -- the model the run starts from;
* ``sft`` -- the policy after the SFT warm start (when it runs);
* ``stage-<i>`` -- the policy at the end of each ScalingInter-RL stage.

A policy's figure is greedy@1 (one greedy episode per task); with ``heldout.k > 1`` also Avg@k /
Pass@k of ``k`` sampled episodes. :func:`comparison_table` lays them out as one row per policy
and one column per environment (overall) and task category.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agentgym.config import PipelineConfig
from agentgym.evaluation.metrics import EvalReport, TaskResult, eval_targets, task_category
from env_adapters.baselines import random_valid_action_success


def heldout_horizon(cfg: PipelineConfig) -> int:
    return cfg.heldout.horizon or max(s.horizon for s in cfg.stages)


def random_valid_report(cfg: PipelineConfig) -> EvalReport:
    """The random-valid-action policy on the eval tasks: per task, the successes over
    ``heldout.random_seeds`` seeds (``n`` = seeds), so a row's ``avg_at_k`` is the mean success
    over seeds and tasks."""
    h = cfg.heldout
    horizon = heldout_horizon(cfg)
    results = []
    for t in eval_targets(cfg):
        wins = np.zeros(len(t.tasks), dtype=int)
        for seed in range(h.random_seeds):
            got = random_valid_action_success(t.spec.name, t.tasks, horizon, seed=seed, env_seed=h.seed,
                                              **t.spec.kwargs)
            wins += np.array([got["per_task"][task] for task in t.tasks], dtype=int)
        for task, w in zip(t.tasks, wins):
            results.append(TaskResult(env=t.label, task_id=task, category=task_category(t.spec.name, task, t.spec.kwargs),
                                      n=h.random_seeds, successes=int(w), reward_mean=float(w) / h.random_seeds))
    return EvalReport.from_tasks(results, k=1, n=h.random_seeds, greedy=False, horizon=horizon, seed=h.seed)


def comparison_table(reports: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per policy label (in the given order): ``success`` per environment (``<env>``,
    overall) and task category (``<env>/<category>``) -- the random policy's mean over seeds, a
    policy's greedy@1 -- and, when sampled reports exist, ``<env> avg@k`` / ``pass@k``."""
    rows = []
    for label, rep in reports.items():
        row: dict[str, Any] = {"policy": label}
        main = EvalReport.from_dict(rep["greedy"] if rep.get("greedy") else rep["sampled"])
        for r in sorted(main.rows, key=lambda r: r.category != "overall"):  # environments first
            key = r.env if r.category == "overall" else f"{r.env}/{r.category}"
            row[key] = round(r.avg_at_k, 4)
        if rep.get("greedy") and rep.get("sampled"):
            sampled = EvalReport.from_dict(rep["sampled"])
            for env in sampled.envs():
                o = sampled.row(env)
                row[f"{env} avg@{sampled.k}"] = round(o.avg_at_k, 4)
                row[f"{env} pass@{sampled.k}"] = round(o.pass_at_k, 4)
        row["tasks"] = sum(r.tasks for r in main.rows if r.category == "overall")
        rows.append(row)
    return rows
