"""``name: agent``: episodes played by an agent program through the OpenAI-compatible gateway.

Not an environment the rollout steps: the agent drives the conversation. For each episode the
pipeline starts the gateway (``agentgym.gateway``) on its engine and calls the entrypoint in a
thread::

    run(base_url: str, task: dict) -> float | dict | None

``base_url`` is the episode's OpenAI base URL (``OpenAI(base_url=base_url, api_key="-")``);
``task`` is ``{"task_id", "seed", "episode_id", **the task's data}``. It returns the reward
(a number, or ``{"reward": r, "success": b}``), or None after posting ``{"reward": r}`` to
``base_url``'s ``../reward``. The environment's keyword arguments (``envs[].kwargs``)::

    entrypoint: examples.openai_agent:run   # package.module:function (required)
    tasks: [{...}, ...]                     # task id i -> tasks[i] merged into task (optional)
    task_file: path.json | path.jsonl       # the same list from a file (optional)
    timeout_s: 600                          # an episode still running then is an infra error
    workers: 16                             # agents at once (default: rollout.max_live_episodes or env_workers)

This class holds and checks those arguments; ``reset`` / ``step`` refuse to run, naming the
gateway, so an agent environment handed to the rollout loop (rollout workers on Ray, a
conformance check) fails with a clear infra error rather than a silent one.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from env_adapters.base import InfraError, StepResult, TextEnv


def load_entrypoint(path: str) -> Callable[..., Any]:
    """The function at ``package.module:function`` (ValueError naming what is wrong); a module
    not found on ``sys.path`` is looked for in the working directory too (``examples.openai_agent``
    from the repository's root, as ``python -m`` would find it)."""
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise ValueError(f"agent entrypoint must be 'package.module:function', got {path!r}")
    module_name, fn_name = path.split(":")
    try:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            cwd = os.getcwd()  # a module of the working directory, as `python -m` finds it
            if e.name is None or not module_name.startswith(e.name) or cwd in sys.path:
                raise
            sys.path.append(cwd)
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"agent entrypoint {path!r}: cannot import {module_name!r}: {e}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"agent entrypoint {path!r}: {module_name} has no function {fn_name!r}")
    return fn


def _read_tasks(task_file: str) -> list[dict[str, Any]]:
    text = Path(task_file).expanduser().read_text(encoding="utf-8")
    if task_file.endswith(".jsonl"):
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    data = json.loads(text)
    return data if isinstance(data, list) else data.get("tasks", [])


class AgentEnv(TextEnv):
    """The ``agent`` environment kind's settings (see the module doc)."""

    name = "agent"

    def __init__(self, entrypoint: str, tasks: list[dict[str, Any]] | None = None, task_file: str | None = None,
                 timeout_s: float = 600.0, workers: int | None = None):
        if tasks is not None and task_file is not None:
            raise ValueError("agent env: give tasks or task_file, not both")
        self.entrypoint = entrypoint
        self.run = load_entrypoint(entrypoint)
        self.tasks = _read_tasks(task_file) if task_file is not None else list(tasks or [])
        if not all(isinstance(t, dict) for t in self.tasks):
            raise ValueError("agent env: every task must be a mapping (its fields go into the agent's task)")
        if not timeout_s > 0:
            raise ValueError(f"agent env: timeout_s must be > 0, got {timeout_s}")
        if workers is not None and workers < 1:
            raise ValueError(f"agent env: workers must be >= 1, got {workers}")
        self.timeout_s, self.workers = float(timeout_s), workers

    def task(self, task_id: int, seed: int, episode_id: str) -> dict[str, Any]:
        """What the agent gets for task ``task_id``: the ids, then the task's data where listed."""
        if self.tasks and not 0 <= task_id < len(self.tasks):
            raise ValueError(f"agent env: task id {task_id} is not in the {len(self.tasks)} listed tasks")
        data = self.tasks[task_id] if self.tasks else {}
        return {"task_id": task_id, "seed": seed, "episode_id": episode_id, **data}

    def _refuse(self) -> InfraError:
        return InfraError("the agent environment is played by its agent through the gateway "
                          "(agentgym.gateway.agents), not stepped by the rollout loop: play it in the "
                          "flow's process (no rollout workers)")

    def reset(self, task_id: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
        raise self._refuse()

    def step(self, action_text: str) -> StepResult:
        raise self._refuse()
