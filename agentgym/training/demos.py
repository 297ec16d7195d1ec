"""Expert demonstrations as episodes: what the SFT warm start trains on.

A scripted expert (``env_adapters.experts``) plays the training tasks; each of its actions is
written in the reply format the policy is trained to produce and tokenized through the same
``ChatFormatter`` as a rollout, so a demonstration is an ordinary :class:`Episode` whose
``loss_mask`` marks the expert's reply tokens -- exactly the ids the policy would sample to say
the same thing. They are committed to the trajectory store like rollouts (``pd.read_parquet``
reads them the same way) under their own dataset id (:func:`demos_dataset_id`).

Reply format: :meth:`ChatFormatter.action_reply_ids` (the same ids action-constrained decoding
scores). In a tool environment the prompt carries its ``tools()`` and the results are glued as tool
messages (``ChatFormatter.glue_step``), as in a rollout; its expert's actions are the
``<tool_call>`` blocks themselves.

``noise`` > 0 makes some turns a uniformly random valid action instead of the expert's (DART):
those replies stay in the conversation as context with ``loss_mask`` 0, so the policy sees
off-track states and learns the expert's recovery from them, never the random actions.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentgym.chat import ChatFormatter
from agentgym.rollout.loop import record_step, state_key
from agentgym.types import Episode
from env_adapters.base import TextEnv
from env_adapters.experts import Expert
from env_adapters.tool_calls import checked_tools

#: ``policy_version`` of a demonstration episode in the store (no policy wrote it).
EXPERT_POLICY_VERSION = -1


@dataclass
class DemoSpec:
    """One demonstration to attempt: task ``task_id`` of ``env`` from ``reset(task_id, seed)``."""

    env: str
    task_id: int
    seed: int
    env_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class DemoStats:
    attempted: int = 0
    kept: int = 0
    expert_turns: int = 0
    noise_turns: int = 0
    reply_tokens: int = 0
    tokens: int = 0
    seconds: float = 0.0
    actions: dict[str, int] = field(default_factory=dict)  # first word of each expert action

    @property
    def success_rate(self) -> float:
        return self.kept / self.attempted if self.attempted else float("nan")


def play_demo(
    env: TextEnv,
    expert: Expert,
    formatter: ChatFormatter,
    spec: DemoSpec,
    *,
    horizon: int,
    stop: list[str],
    system_prompt: str | None,
    noise: float,
    rng: random.Random,
    episode_id: str,
) -> Episode:
    """One expert episode of ``spec`` as token ids (the expert's replies mask 1, the rest 0)."""
    ep = Episode(episode_id, f"demo-{spec.env}-{spec.task_id}", spec.env, spec.task_id, spec.seed, horizon)
    obs, info = env.reset(spec.task_id, spec.seed)
    expert.reset(env, obs, info)
    system = system_prompt if system_prompt is not None else env.system_prompt()
    ep.append(formatter.start(system or None, obs, tools=checked_tools(env.tools())), sampled=False)
    state = state_key(obs, info)
    for turn in range(horizon):
        valid = env.valid_actions() or []
        from_expert = not (noise > 0 and valid and rng.random() < noise)
        action = expert.act(obs) if from_expert else rng.choice(valid)
        if action is None:  # the expert gives up: not a demonstration
            break
        ids = formatter.action_reply_ids(action, stop)
        # the expert's reply is trained on (mask 1, log-prob 0: nothing sampled it); a noise
        # reply is context only
        ep.append(ids, sampled=from_expert, logprobs=[0.0] * len(ids) if from_expert else None)
        reply = formatter.reply_text(ids)
        t0 = time.perf_counter()
        res = env.step(reply)
        latency = (time.perf_counter() - t0) * 1000.0
        # the rollout's own bookkeeping: the same rewards, Turn rows and end flags
        if record_step(ep, turn, horizon, obs, reply, res, gen_tokens=len(ids) if from_expert else 0,
                       latency_ms=latency, state=state):
            break
        ep.append(formatter.glue_step(res.observation, res.info, formatter.ends_turn(ids)), sampled=False)
        obs, state = res.observation, state_key(res.observation, res.info)
    if ep.reward >= 1.0:
        ep.success = True
    ep.validate()
    return ep


def trim_after_last_reply(ep: Episode) -> Episode:
    """``ep`` without the tokens after its last trained reply (the final observation carries no
    loss; dropping it saves a forward over a few hundred tokens per demonstration)."""
    last = max((i for i, m in enumerate(ep.loss_mask) if m), default=-1) + 1
    return Episode(ep.episode_id, ep.group_id, ep.env, ep.task_id, ep.seed, ep.horizon,
                   ep.input_ids[:last], ep.loss_mask[:last], ep.old_logprobs[:last], ep.turns,
                   ep.reward, ep.success, ep.terminated, ep.truncated, ep.infra_error, ep.error)


def demo_specs(envs: list[tuple[str, list[int], dict[str, Any]]], first_seed: int) -> Callable[[int], DemoSpec]:
    """Attempt ``k`` -> its ``DemoSpec``: the environments' training tasks round-robin (each
    environment in turn, then its tasks in order), with reset seed ``first_seed + k // n`` where
    ``n`` is the number of (env, task) pairs -- every pass over the tasks plays new instances."""
    pairs = [(name, t, kw) for name, tasks, kw in envs for t in tasks]
    if not pairs:
        raise ValueError("demonstrations need at least one training task")
    # interleave environments so a budget cut keeps every environment represented
    by_env: dict[str, list[tuple[str, int, dict]]] = {}
    for p in pairs:
        by_env.setdefault(p[0], []).append(p)
    order: list[tuple[str, int, dict]] = []
    lists = list(by_env.values())
    for i in range(max(len(x) for x in lists)):
        order.extend(x[i] for x in lists if i < len(x))

    def spec(k: int) -> DemoSpec:
        name, task, kw = order[k % len(order)]
        return DemoSpec(name, task, first_seed + k // len(order), dict(kw))

    return spec


def generate_demos(
    formatter: ChatFormatter,
    envs: list[tuple[str, list[int], dict[str, Any]]],
    *,
    episodes: int,
    horizon: int,
    stop: list[str],
    system_prompt: str | None,
    noise: float,
    seed: int,
    max_attempts: int | None = None,
    make_env: Callable[..., TextEnv],
    make_expert: Callable[[str], Expert],
    on_episode: Callable[[int, int], None] | None = None,
) -> tuple[list[Episode], DemoStats]:
    """Play expert episodes until ``episodes`` succeed (at most ``max_attempts``, default
    ``4 x episodes``); returns the successful ones, trimmed after their last reply, and stats.

    Deterministic in ``seed``: the tasks, their reset seeds (``1_000 + seed * 100_000`` on, far
    from the rollouts' and evaluations' seeds) and the noise draws.
    """
    rng = random.Random(seed)
    spec_of = demo_specs(envs, first_seed=1_000 + seed * 100_000)
    limit = max_attempts if max_attempts is not None else 4 * episodes
    stats = DemoStats()
    kept: list[Episode] = []
    envs_open: dict[tuple[str, str], TextEnv] = {}
    experts: dict[str, Expert] = {}
    t0 = time.perf_counter()
    try:
        k = 0
        while len(kept) < episodes and k < limit:
            spec = spec_of(k)
            key = (spec.env, json.dumps(spec.env_kwargs, sort_keys=True))
            env = envs_open.get(key) or envs_open.setdefault(key, make_env(spec.env, **spec.env_kwargs))
            expert = experts.get(spec.env) or experts.setdefault(spec.env, make_expert(spec.env))
            ep = play_demo(env, expert, formatter, spec, horizon=horizon, stop=stop,
                           system_prompt=system_prompt, noise=noise, rng=rng,
                           episode_id=f"demo-{k:06d}-{spec.env}-{spec.task_id}-s{spec.seed}")
            stats.attempted += 1
            k += 1
            if ep.success:
                kept.append(trim_after_last_reply(ep))
                stats.kept += 1
                for t in ep.turns:
                    if t.gen_tokens:
                        stats.expert_turns += 1
                        word = (t.parsed_action or "?").split(" ")[0]
                        stats.actions[word] = stats.actions.get(word, 0) + 1
                    else:
                        stats.noise_turns += 1
                stats.reply_tokens += sum(kept[-1].loss_mask)
                stats.tokens += len(kept[-1].input_ids)
            if on_episode:
                on_episode(len(kept), episodes)
    finally:
        for env in envs_open.values():
            env.close()
    stats.seconds = time.perf_counter() - t0
    return kept, stats


def demos_dataset_id(payload: dict[str, Any]) -> str:
    """A store run id for a demonstration set: ``demos-<hash>`` of everything that decides its
    tokens (environments and tasks, expert settings, reply format, the model's tokenizer), so
    runs with the same settings share one dataset and a change never reuses a stale one."""
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]
    return f"demos-{digest}"
