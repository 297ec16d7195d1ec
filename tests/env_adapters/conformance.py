"""The conformance check every ``TextEnv`` adapter must pass (in the spirit of gymnasium's
``utils/env_checker.py``): call :func:`check_env` from a test with a factory and a few task ids.

What it checks, for every task id:

* **determinism** -- two fresh instances reset to the same ``(task, seed)`` give the same first
  observation, and replaying the same scripted replies gives the same observations, rewards and
  flags; resetting an instance again reproduces the first observation;
* **types** -- observations are ``str``, rewards ``float`` (not bool) in ``[0, 1]``, ``terminated``
  / ``truncated`` are ``bool``, ``info`` is a ``dict``; ``system_prompt()`` is a ``str``;
  ``valid_actions()`` is ``None`` or a list of ``str``;
* **a scripted run** of ``horizon`` steps never raises (the script replays ``valid_actions()``
  in a seeded order, or a fixed reply when the adapter lists none) and stops at ``terminated``;
* **format errors** -- garbage replies (``""``, control bytes, 5,000 characters, a bare
  ``"Action:"``) return a normal :class:`StepResult` with ``info["format_error"] is True``,
  reward 0 and ``terminated`` False, never an exception; a well-formed reply does not set it;
* **close** -- ``close()`` twice does not raise, and a make/reset/step/close cycle leaves no
  extra threads, child processes or open file descriptors behind.

It returns a small report (per-step latency, observation sizes) that tests may print.
"""

from __future__ import annotations

import gc
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from env_adapters.base import StepResult, TextEnv

GARBAGE_REPLIES = ["", "\x00\x01", "x" * 5000, "Action:"]
FALLBACK_REPLY = "Thought:\nI will look around.\n\nAction:\nlook"


def _check_reset(env: TextEnv, task_id: int, seed: int) -> tuple[str, dict]:
    out = env.reset(task_id, seed=seed)
    assert isinstance(out, tuple) and len(out) == 2, f"reset must return (obs, info), got {out!r}"
    obs, info = out
    assert isinstance(obs, str) and obs, f"reset observation must be a non-empty str: {obs!r}"
    assert isinstance(info, dict), f"reset info must be a dict, got {type(info)}"
    return obs, info


def _check_step(result: Any, *, where: str) -> StepResult:
    assert isinstance(result, StepResult), f"{where}: step must return StepResult, got {result!r}"
    assert isinstance(result.observation, str), f"{where}: observation must be str"
    assert isinstance(result.reward, float) and not isinstance(result.reward, bool), (
        f"{where}: reward must be a float, got {type(result.reward).__name__}")
    assert 0.0 <= result.reward <= 1.0, f"{where}: reward {result.reward} outside [0, 1]"
    assert isinstance(result.terminated, bool), f"{where}: terminated must be bool"
    assert isinstance(result.truncated, bool), f"{where}: truncated must be bool"
    assert isinstance(result.info, dict), f"{where}: info must be a dict"
    return result


def _script(env: TextEnv, rng: random.Random) -> str:
    actions = env.valid_actions()
    assert actions is None or (isinstance(actions, list)
                               and all(isinstance(a, str) for a in actions)), (
        f"valid_actions() must be None or list[str], got {actions!r}")
    if not actions:
        return FALLBACK_REPLY
    return f"Thought:\nLet me try something.\n\nAction:\n{rng.choice(actions)}"


def _run(env: TextEnv, task_id: int, seed: int, horizon: int, script_seed: int) -> list[tuple]:
    """Reset, then play the scripted policy; returns the trace and checks every step."""
    obs, _ = _check_reset(env, task_id, seed)
    trace: list[tuple] = [(obs,)]
    rng = random.Random(script_seed)
    for t in range(horizon):
        reply = _script(env, rng)
        r = _check_step(env.step(reply), where=f"task {task_id} step {t}")
        assert r.info.get("format_error") is not True, (
            f"task {task_id} step {t}: a well-formed reply was a format error: {reply!r}")
        trace.append((reply, r.observation, r.reward, r.terminated, r.truncated))
        if r.terminated or r.truncated:
            break
    return trace


def _resources() -> tuple[int, int, int]:
    gc.collect()
    try:
        fds = len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux
        fds = 0
    try:
        import psutil

        children = len(psutil.Process().children(recursive=True))
    except Exception:  # noqa: BLE001 - psutil is optional
        children = 0
    return threading.active_count(), children, fds


def check_env(
    make: Callable[[], TextEnv],
    task_ids: list[int],
    horizon: int = 5,
    seeds: tuple[int, ...] = (0, 1),
    check_resources: bool = True,
) -> dict[str, Any]:
    """Run the conformance checks; raises ``AssertionError`` naming the first violation.

    ``check_resources=False`` skips the thread/process/fd accounting of ``close()`` (for a
    client whose server runs in this same process, e.g. the HTTP conformance run).
    """
    assert task_ids, "give at least one task id"
    report: dict[str, Any] = {"steps": 0, "step_s": 0.0, "resets": 0, "reset_s": 0.0,
                              "max_obs_chars": 0}

    # ---- close releases resources (warm-up cycle first, so lazy imports are not counted)
    warm = make()
    _check_reset(warm, task_ids[0], 0)
    warm.close()
    before = _resources()
    env = make()
    _run(env, task_ids[0], 0, min(horizon, 2), 0)
    env.close()
    env.close()  # idempotent
    after = _resources() if check_resources else before
    assert after[0] <= before[0], f"close() left threads behind: {before[0]} -> {after[0]}"
    assert after[1] <= before[1], f"close() left child processes: {before[1]} -> {after[1]}"
    assert after[2] <= before[2], f"close() left file descriptors open: {before[2]} -> {after[2]}"

    a, b = make(), make()
    try:
        assert isinstance(a.system_prompt(), str), "system_prompt() must return str"
        assert isinstance(getattr(a, "name", None), str) and a.name != "base", "set a name"
        for task_id in task_ids:
            for seed in seeds:
                # ---- determinism across instances (and scripted run never raises)
                t0 = time.perf_counter()
                trace_a = _run(a, task_id, seed, horizon, script_seed=task_id * 7 + seed)
                elapsed = time.perf_counter() - t0
                trace_b = _run(b, task_id, seed, horizon, script_seed=task_id * 7 + seed)
                assert trace_a[0] == trace_b[0], (
                    f"task {task_id} seed {seed}: two instances reset to different observations")
                assert trace_a == trace_b, (
                    f"task {task_id} seed {seed}: the same replies gave different results")
                report["steps"] += len(trace_a) - 1
                report["step_s"] += elapsed
                report["max_obs_chars"] = max(
                    [report["max_obs_chars"], len(trace_a[0][0])]
                    + [len(s[1]) for s in trace_a[1:]])

                # ---- re-reset of a used instance reproduces the first observation
                t0 = time.perf_counter()
                obs_again, _ = _check_reset(a, task_id, seed)
                report["reset_s"] += time.perf_counter() - t0
                report["resets"] += 1
                assert obs_again == trace_a[0][0], (
                    f"task {task_id} seed {seed}: a second reset gave a different observation")

            # ---- garbage replies are format errors, not exceptions
            _check_reset(a, task_id, 0)
            for junk in GARBAGE_REPLIES:
                r = _check_step(a.step(junk), where=f"task {task_id} reply {junk[:20]!r}")
                assert r.info.get("format_error") is True, (
                    f"task {task_id}: reply {junk[:20]!r} must be a format error, got {r.info}")
                assert r.reward == 0.0 and not r.terminated, (
                    f"task {task_id}: a format error must give reward 0 and not terminate")
                assert r.observation, "a format error must explain itself in the observation"
    finally:
        a.close()
        b.close()
    # the step time includes the reset that starts each scripted run
    report["ms_per_step"] = 1000 * report["step_s"] / max(report["steps"], 1)
    report["ms_per_reset"] = 1000 * report["reset_s"] / max(report["resets"], 1)
    return report
