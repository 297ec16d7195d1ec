"""The learning curve of a pipeline run: held-out success against environment steps and minutes
of running.

Built from what the run logged to MLflow (so a resumed run draws its whole history): the
iteration metrics ``episodes`` and ``turns_per_episode`` give the environment steps played up to
each global step, their timestamps the minutes of running (``running_minutes``: without the
pause of a run killed in one session and resumed in a later one), and the held-out results
(``heldout-by-policy/<label>.overall.greedy_at_1``) are placed at the step where their policy stopped
training (base and SFT at 0 environment steps of RL, ``stage-k`` at the end of stage k).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from agentgym.evaluation.heldout_metrics import RANDOM, policy_metric
from agentgym.tracking.metric_history import metric_history


@dataclass
class CurvePoint:
    """One held-out evaluation: ``label`` (base, sft, stage-0, ...), its success, and the RL
    environment steps and minutes of running at which its policy was taken."""

    label: str
    success: float
    env_steps: float
    minutes: float


@dataclass
class LearningCurve:
    """Per-iteration training numbers and the held-out points of one run."""

    env_steps: list[float] = field(default_factory=list)  # cumulative, per global step
    minutes: list[float] = field(default_factory=list)  # minutes of running (``running_minutes``)
    train_success: list[float] = field(default_factory=list)  # sampled success per iteration
    heldout: list[CurvePoint] = field(default_factory=list)
    random_valid: float | None = None  # the random-valid-action baseline on the same tasks

    def steps_at(self, global_step: int) -> tuple[float, float]:
        """(environment steps, minutes) once ``global_step`` iterations have run (0: none)."""
        if global_step <= 0 or not self.env_steps:
            return 0.0, 0.0
        i = min(global_step, len(self.env_steps)) - 1
        return self.env_steps[i], self.minutes[i]


#: the per-iteration phases the pipeline times (seconds), which together make an iteration
ITERATION_PHASES = ("rollout_seconds", "update_seconds", "time/advantages_compute_s",
                    "time/advantages_store_read_s", "time/advantages_store_write_s")


def running_minutes(start_ms: int, end_ms: int | None, stamps_ms: list[int],
                    expected_s: list[float], tail_s: float) -> tuple[list[float], float]:
    """Minutes a run spent running at the end of each iteration, and in all, without the pauses of
    a run killed in one session and resumed in a later one.

    ``stamps_ms[i]``: when iteration ``i``'s metrics were logged (MLflow, ms); ``expected_s[i]``:
    the seconds the pipeline measured for iteration ``i`` plus the held-out evaluation that ran
    before it (``measured_seconds``); ``tail_s``: the evaluation after the last iteration. A gap
    between two stamps far above what the pipeline measured for it (more than 1.5 times plus 2
    minutes) held a pause: it counts the measured seconds instead. Overlapping phases (async RL)
    keep their gaps, which are shorter than the sum of their parts. ``end_ms`` None: the run has
    not ended (total NaN)."""
    out, total, prev = [], 0.0, start_ms
    for stamp, expected in zip(stamps_ms, expected_s):
        total += _gap_s(stamp - prev, expected)
        out.append(total / 60)
        prev = stamp
    if end_ms is None:
        return out, float("nan")
    return out, (total + _gap_s(end_ms - prev, tail_s)) / 60


def _gap_s(gap_ms: float, expected_s: float) -> float:
    gap_s = gap_ms / 1000
    return float(expected_s) if gap_s > 1.5 * expected_s + 120 else gap_s


def measured_seconds(client, run, iterations: int, stage_ends: list[int]) -> tuple[list[float], float]:
    """Seconds the pipeline measured before each of the MLflow ``run``'s first ``iterations``
    iterations' metrics were logged, and after the last: the iteration's phases
    (``ITERATION_PHASES``) plus the held-out evaluation of a stage, counted after the stage's last
    iteration (``stage_ends[k]``: the global step count at the end of stage k). The two parts are
    ``running_minutes``' ``expected_s`` and ``tail_s``."""
    out = [0.0] * (iterations + 1)
    for key in ITERATION_PHASES:
        for m in metric_history(client, run.info.run_id, key):
            if 0 <= m.step < iterations:
                out[m.step] += m.value
    for k, end in enumerate(stage_ends):
        if 0 < end <= iterations:
            out[end] += policy_metric(run.data.metrics, f"stage-{k}", "seconds") or 0.0
    return out[:-1], out[-1]


def from_mlflow(client, mlflow_run_id: str, stage_ends: list[int]) -> LearningCurve:
    """Read a pipeline run's curve from MLflow. ``stage_ends[k]`` is the global step count at the
    end of stage k (``schedule.stage_start(stages, k + 1)``)."""
    run = client.get_run(mlflow_run_id)

    def history(key: str) -> dict[int, tuple[float, int]]:
        return {m.step: (m.value, m.timestamp) for m in metric_history(client, mlflow_run_id, key)}

    episodes, turns, success = history("episodes"), history("turns_per_episode"), history("success_rate")
    curve = LearningCurve()
    total = 0.0
    steps = sorted(set(episodes) & set(turns))
    for step in steps:
        total += episodes[step][0] * turns[step][0]
        curve.env_steps.append(total)
        curve.train_success.append(success.get(step, (float("nan"), 0))[0])
    expected, tail = measured_seconds(client, run, len(steps), stage_ends)
    curve.minutes, _ = running_minutes(run.info.start_time, run.info.end_time,
                                       [turns[step][1] for step in steps], expected, tail)
    metrics = run.data.metrics
    curve.random_valid = policy_metric(metrics, RANDOM, "overall/avg_at_1")
    for label in ["base", "sft"] + [f"stage-{k}" for k in range(len(stage_ends))]:
        score = policy_metric(metrics, label, "overall/greedy_at_1")
        if score is None:
            continue
        if label.startswith("stage-"):
            at_steps, minutes = curve.steps_at(stage_ends[int(label.split("-")[1])])
        else:
            at_steps, minutes = 0.0, 0.0
        curve.heldout.append(CurvePoint(label, score, at_steps, minutes))
    return curve


def plot(curve: LearningCurve, path: str | Path, title: str) -> Path:
    """Three panels -- held-out success against RL environment steps and against minutes of running
    (with the random-valid baseline), and train success per iteration -- saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    xs = {"env steps": [p.env_steps for p in curve.heldout], "minutes running": [p.minutes for p in curve.heldout]}
    ys = [p.success for p in curve.heldout]
    for ax, (name, x) in zip(axes[:2], xs.items()):
        ax.plot(x, ys, marker="o", label="held-out greedy success")
        for p, xi in zip(curve.heldout, x):
            ax.annotate(p.label, (xi, p.success), textcoords="offset points", xytext=(3, 4), fontsize=7)
        if curve.random_valid is not None:
            ax.axhline(curve.random_valid, color="grey", ls=":", label="random valid action")
        ax.set_xlabel("RL env steps" if name == "env steps" else "minutes of running")
        ax.set_ylim(0, 1)
        ax.set_title(f"held-out success vs {name}")
        ax.legend(fontsize=7, loc="lower right")
    axes[2].plot(curve.env_steps, curve.train_success, color="tab:green")
    axes[2].set_xlabel("RL env steps")
    axes[2].set_ylim(0, 1)
    axes[2].set_title("train success (sampled) per iteration")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
