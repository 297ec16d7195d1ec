"""The ``agent`` environment kind: episodes played by agent programs through the gateway.

``envs: [{name: agent, kwargs: {entrypoint: "examples.openai_agent:run", tasks: [...]}, tasks: [0, 1]}]``
(``env_adapters.agent``). For one rollout, :func:`play_agents` starts a :class:`Gateway` on the
session's engine behind a :class:`GatewayServer` on a free 127.0.0.1 port, registers each
episode of the plan (its id, group, task and seed), calls the entrypoint
``run(base_url, task)`` of each in its own thread (``workers`` at once), and finishes each
episode with the reward the agent returned or posted. Episodes are the rollout's
``Episode`` records (env ``agent``): the pipeline stores and trains them like any other.

An agent that raises, returns something that is not a reward, makes no model call or runs past
``timeout_s`` makes its episode an infra error (unscored), as a broken environment does. A
wrong entrypoint or task list is a configuration error (ValueError) before any episode plays.

:func:`iter_played` / :func:`run_played` are the rollout loop's ``iter_episodes`` /
``run_episodes`` for a plan that may hold agent episodes: the loop plays the others, the
gateway these.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from agentgym.chat import ChatFormatter
from agentgym.gateway.recorder import AGENT_ENV, EngineWorker, Gateway, GatewaySettings, outcome
from agentgym.gateway.server import GatewayServer
from agentgym.rollout.engines.base import InferenceEngine
from agentgym.rollout.loop import EpisodeSpec, RolloutSettings, iter_episodes
from agentgym.types import Episode
from env_adapters.agent import AgentEnv
from env_adapters.base import TextEnv


def play_agents(engine: InferenceEngine, formatter: ChatFormatter, specs: list[EpisodeSpec],
                settings: RolloutSettings, on_turn: Callable[[int, int], None] | None = None,
                model_name: str = "policy") -> Iterator[tuple[int, Episode]]:
    """Play the ``agent`` episodes ``specs`` through the gateway; (spec index, episode) as each
    ends. ``settings``: the rollout's (horizon, token budgets, sampling, seed: each reply is
    seeded ``episode_turn_seed(settings.seed, episode_id, turn)`` unless the agent gives a seed)."""
    agents: dict[str, AgentEnv] = {}
    items: list[tuple[int, EpisodeSpec, AgentEnv, dict[str, Any]]] = []
    for i, spec in enumerate(specs):
        key = json.dumps(spec.env_kwargs, sort_keys=True, default=str)
        if key not in agents:
            agents[key] = AgentEnv(**spec.env_kwargs)
        env = agents[key]
        items.append((i, spec, env, env.task(spec.task_id, spec.seed, spec.episode_id)))
    if not items:
        return
    cap = min(len(items), *(e.workers or settings.max_live or settings.env_workers or len(items)
                            for e in agents.values()))
    worker = EngineWorker(engine, max_batch=max(1, cap), on_call=on_turn)
    gateway = Gateway(engine, formatter, GatewaySettings.from_rollout(settings, model_name), worker=worker)
    done: queue.Queue[tuple[int, Any, str | None]] = queue.Queue()

    def run(k: int, url: str) -> None:
        _, _, env, task = items[k]
        try:
            done.put((k, env.run(url, task), None))
        except BaseException as e:  # noqa: BLE001 - the agent's failure is its episode's, not the rollout's
            done.put((k, None, f"agent: {type(e).__name__}: {e}"))

    def finish(k: int, value: Any, agent_error: str | None, error: str | None = None) -> Episode:
        episode_id = items[k][1].episode_id
        reward = success = None
        if agent_error is None and error is None:
            try:
                reward, success = outcome(value)
            except ValueError as e:
                error = str(e)
        return gateway.finish(episode_id, reward=reward, success=success, error=error, agent_error=agent_error)

    server = GatewayServer(gateway)
    pending = list(range(len(items)))[::-1]
    running: dict[int, float] = {}  # item -> deadline
    try:
        while pending or running:
            while pending and len(running) < cap:
                k = pending.pop()
                _, spec, env, _ = items[k]
                gateway.register(spec.episode_id, group_id=spec.group_id, env=spec.env, task_id=spec.task_id,
                                 seed=spec.seed, horizon=settings.horizon)
                running[k] = time.monotonic() + env.timeout_s
                threading.Thread(target=run, args=(k, server.episode_url(spec.episode_id)),
                                 name=f"agent-{spec.episode_id}", daemon=True).start()
            wait = max(0.01, min(running.values()) - time.monotonic())
            try:
                k, value, agent_error = done.get(timeout=min(wait, 1.0))
            except queue.Empty:
                now = time.monotonic()
                for k in [k for k, t in running.items() if t <= now]:
                    del running[k]
                    yield items[k][0], finish(k, None, None, f"agent: still running after timeout_s="
                                              f"{items[k][2].timeout_s:g} s; its episode was ended")
                continue
            if k in running:  # else it had timed out and was finished already
                del running[k]
                yield items[k][0], finish(k, value, agent_error)
    finally:  # the consumer stopped early, or something failed: end what is still open
        for episode_id in gateway.open_ids():
            try:
                gateway.finish(episode_id, error="the rollout stopped")
            except ValueError:
                pass
        server.stop()
        gateway.close()


def iter_played(engine: InferenceEngine, formatter: ChatFormatter, specs: list[EpisodeSpec],
                settings: RolloutSettings, make_env: Callable[..., TextEnv],
                on_turn: Callable[[int, int], None] | None = None) -> Iterator[Episode]:
    """``iter_episodes`` over a plan that may hold ``agent`` episodes: the rollout loop plays
    the others, then the gateway these (:func:`play_agents`); each episode as it ends."""
    played = [s for s in specs if s.env != AGENT_ENV]
    agents = [s for s in specs if s.env == AGENT_ENV]
    if played or not agents:
        yield from iter_episodes(engine, formatter, played, settings, make_env=make_env, on_turn=on_turn)
    for _, ep in play_agents(engine, formatter, agents, settings, on_turn):
        yield ep


def run_played(engine: InferenceEngine, formatter: ChatFormatter, specs: list[EpisodeSpec],
               settings: RolloutSettings, make_env: Callable[..., TextEnv],
               on_turn: Callable[[int, int], None] | None = None) -> list[Episode]:
    """:func:`iter_played`, collected in ``specs`` order (as ``run_episodes``)."""
    by_id = {ep.episode_id: ep for ep in iter_played(engine, formatter, specs, settings, make_env, on_turn)}
    return [by_id[s.episode_id] for s in specs]
