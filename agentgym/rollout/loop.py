"""The multi-turn rollout loop.

Each turn makes **one** batched ``generate`` over every live episode, then steps all their
environments concurrently in a thread pool (N episodes whose environment takes L ms a step
cost about L per turn, not N*L). Token-in, token-out: the ids and log-probs the engine sampled
are stored as they are; template glue and observations are appended as ids with mask 0.

At most ``RolloutSettings.max_live`` episodes play at once (0: all); queued ones start as
others end, and ``iter_episodes`` yields each episode when it ends, so a caller that writes
them out (``PolicySession.collect`` with the store's ``EpisodeWriter``) holds a bounded number
of episodes however many the iteration has. ``run_episodes`` collects them, in spec order.

Episode outcome: reward = sum of step rewards (or the last one, where the adapter reports a
running score with ``info["reward_is_cumulative"]``), clipped to [0, 1]; each turn's ``reward``
is its increment, so the turns add up to the outcome. An environment fault
(``InfraError``, or a step whose reward is NaN, Inf or not a number) marks the episode
``infra_error``; it stops, keeps no reward, and the advantage step leaves it out of every
baseline.

``constrain_actions``: where the environment lists its valid actions, the reply is not free
text but one of those actions in the reply format (``ChatFormatter.action_reply_ids``), drawn by
the engine's ``choose`` in proportion to the policy's probability of saying it; where it lists
none (``valid_actions()`` is ``None`` or empty), the reply is generated as usual. With
``action_logprob: renormalised`` a chosen reply's stored log-probs are those of the distribution
it was drawn from, renormalised over the candidates (``agentgym.training.action_logprob``), and
the episode records the candidates (``Episode.action_starts`` / ``action_candidates``). Tool
environments (``env_adapters.tool_calls.ToolEnv``) list none by default, so their replies are
always generated freely, even with ``constrain_actions``.

Tools: at its start an episode asks its environment for ``tools()`` and the first prompt carries
them (``ChatFormatter.start(..., tools=...)``); after a step whose info has ``tool_results`` the
results are glued as the template's tool messages (``ChatFormatter.glue_step``: ``tool_glue``),
else the observation as a user turn. A step whose ``tool_results`` / ``tool_calls`` are malformed,
or an environment whose ``tools()`` is, is an infra error of that episode.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from agentgym.chat import ChatFormatter
from agentgym.context import ContextPolicy
from agentgym.rollout.engines.base import InferenceEngine, SamplingParams
from agentgym.rollout.env_threads import env_pool
from agentgym.training.action_logprob import RENORMALISED, choice_index, renormalised_logprobs
from agentgym.types import Episode, Turn
from env_adapters.base import InfraError, StepResult, TextEnv
from env_adapters.tool_calls import checked_tool_results, checked_tools


@dataclass
class EpisodeSpec:
    """What to play: one episode of ``task_id`` in environment ``env``."""

    env: str
    task_id: int
    seed: int
    group_id: str
    episode_id: str
    env_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutSettings:
    horizon: int
    max_new_tokens: int  # rollout.max_new_tokens
    max_context_tokens: int = 4096
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    stop: list[str] = field(default_factory=list)
    env_workers: int = 64  # as RolloutConfig.env_workers
    seed: int = 0
    system_prompt: str | None = None
    # At most this many episodes play at once (0: all); bounds the rollout's memory (token
    # lists, KV caches, open environments) when iterations have many episodes.
    max_live: int = 0
    constrain_actions: bool = False
    # what the policy sees of a long conversation (agentgym.context): truncate, window or summary
    context_policy: str = "truncate"
    context_window: int = 4
    # sampling seeds (rollout.sampling_seeds): False, one seed per batched call (turn_seed of the
    # call index: an episode's replies depend on the batch it plays in); True, one per episode
    # and turn (episode_turn_seed: the same replies whichever batch, max_live or worker plays it)
    seeds_per_episode: bool = False
    # rollout.action_logprob: "renormalised" stores a constrained reply's log-probs renormalised
    # over its candidates, and the candidates (Episode.action_starts / action_candidates)
    action_logprob: str = "policy"
    # rollout.action_temperature: the choice among the candidates is q^(1/t), renormalised
    action_temperature: float = 1.0

    @classmethod
    def from_config(cls, cfg: Any, horizon: int, seed: int, greedy: bool = False) -> "RolloutSettings":
        """The settings a ``PipelineConfig`` (``cfg.rollout``, ``cfg.system_prompt``) asks for."""
        r = cfg.rollout
        return cls(
            horizon=horizon, max_new_tokens=r.max_new_tokens, max_context_tokens=r.max_context_tokens,
            temperature=r.temperature, top_p=r.top_p, greedy=greedy, stop=list(r.stop),
            env_workers=r.env_workers, seed=seed, system_prompt=cfg.system_prompt,
            max_live=r.max_live_episodes, constrain_actions=r.constrain_actions,
            context_policy=r.context_policy.value, context_window=r.context_window,
            seeds_per_episode=cfg.seeds_per_episode, action_logprob=r.action_logprob,
            action_temperature=r.action_temperature,
        )


@dataclass
class _Live:
    ep: Episode
    env: TextEnv | None
    observation: str = ""
    state: str = ""  # state_key() of the observation
    done: bool = False
    index: int = 0  # position in the specs
    turn: int = 0  # turns taken so far
    # context policies (agentgym.context): where the current segment starts in ep.input_ids, the
    # first turn it holds whole, the first prompt's ids, each finished turn's reply + glue ids,
    # and the environment's state summary after each step (summary policy only)
    seg_start: int = 0
    seg_first_turn: int = 0
    system: str | None = None
    tools: list[dict[str, Any]] | None = None  # the environment's tools() for this episode
    head: list[int] = field(default_factory=list)
    turn_ids: list[list[int]] = field(default_factory=list)
    summaries: list[str] = field(default_factory=list)

    def prompt(self) -> list[int]:
        """The ids the engine sees for this episode's next reply: its current segment (the
        episode's own list while there is one segment: no copy)."""
        return self.ep.input_ids[self.seg_start:] if self.seg_start else self.ep.input_ids

    def prompt_len(self) -> int:
        return len(self.ep.input_ids) - self.seg_start


def turn_seed(seed: int, turn: int) -> int:
    """Generation seed of one turn, derived from the rollout seed (explicit, reproducible)."""
    digest = hashlib.sha256(f"{seed}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def episode_turn_seed(seed: int, episode_id: str, turn: int) -> int:
    """Generation seed of episode ``episode_id``'s reply at turn ``turn`` (0: its first reply)
    under rollout seed ``seed`` (``RolloutSettings.seeds_per_episode``): the first 63 bits of
    ``sha256("{seed}:{episode_id}:{turn}")``, little-endian. It names the reply, not the batch it
    is sampled in, so an episode plays the same whichever batch, ``max_live`` or rollout worker
    it plays in; the episodes of a GRPO group (distinct ids) still sample differently. (Fits a
    ``torch.Generator`` seed; the vLLM engines reduce it to their 31-bit request seed.)"""
    digest = hashlib.sha256(f"{seed}:{episode_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _safe(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    try:
        return fn(), None
    except InfraError as e:
        return None, f"infra: {e}"
    except Exception as e:  # noqa: BLE001 - an adapter crash is an infra fault, not reward 0
        return None, f"infra: {type(e).__name__}: {e}"


def run_episodes(
    engine: InferenceEngine,
    formatter: ChatFormatter,
    specs: list[EpisodeSpec],
    settings: RolloutSettings,
    make_env: Callable[..., TextEnv],
    on_turn: Callable[[int, int], None] | None = None,
) -> list[Episode]:
    """Play every episode in ``specs`` to termination, the horizon or the context limit;
    returns them in ``specs`` order (all held in memory: ``iter_episodes`` streams them)."""
    done = sorted(_play(engine, formatter, specs, settings, make_env, on_turn), key=lambda x: x[0])
    return [ep for _, ep in done]


def iter_episodes(
    engine: InferenceEngine,
    formatter: ChatFormatter,
    specs: list[EpisodeSpec],
    settings: RolloutSettings,
    make_env: Callable[..., TextEnv],
    on_turn: Callable[[int, int], None] | None = None,
) -> Iterator[Episode]:
    """Play ``specs`` like ``run_episodes`` but yield each episode as soon as it ends (in the
    order they end), so a caller that writes them out holds at most ``settings.max_live``
    playing episodes plus what it buffers itself."""
    for _, ep in _play(engine, formatter, specs, settings, make_env, on_turn):
        yield ep


def _play(
    engine: InferenceEngine,
    formatter: ChatFormatter,
    specs: list[EpisodeSpec],
    settings: RolloutSettings,
    make_env: Callable[..., TextEnv],
    on_turn: Callable[[int, int], None] | None,
) -> Iterator[tuple[int, Episode]]:
    """The loop: (spec index, episode) as each episode ends.

    At most ``settings.max_live`` episodes (0: all) play at once; when some end, queued specs
    start in their place, so each ``generate`` batches episodes that may be at different turns.
    Call k of ``generate`` samples with ``turn_seed(seed, k)``: with every episode live at once
    (the default for small iterations) call k is turn k, as before the cap existed. With
    ``settings.seeds_per_episode`` each episode's reply at turn t samples with
    ``episode_turn_seed(seed, episode_id, t)`` instead, whatever call it is in.
    """
    queue = deque(range(len(specs)))
    cap = settings.max_live or len(specs)
    live: list[_Live] = []
    # kept between rollouts (env_threads); it makes threads as calls need them, so never more
    # than the live episodes
    with env_pool(max(1, settings.env_workers)) as pool:
        try:
            call = 0
            while queue or live:
                starting = [queue.popleft() for _ in range(min(cap - len(live), len(queue)))]
                live += _start_episodes(pool, formatter, specs, starting, settings, make_env)
                fits = _ready(live, settings)
                if fits:
                    _play_turn(engine, formatter, pool, fits, settings, call)
                    engine.release(lv.ep.episode_id for lv in fits if lv.done)
                    if on_turn:
                        on_turn(call, len(fits))
                    call += 1
                ended = [lv for lv in live if lv.done]
                live = [lv for lv in live if not lv.done]
                for lv in ended:
                    yield lv.index, _finish(lv)
        finally:  # also when the consumer stops early or raises: no env or cache left behind
            engine.release(lv.ep.episode_id for lv in live)
            for lv in live:
                if lv.env is not None:
                    _safe(lv.env.close)


def _start_episodes(pool: ThreadPoolExecutor, formatter: ChatFormatter, specs: list[EpisodeSpec],
                    indices: list[int], settings: RolloutSettings,
                    make_env: Callable[..., TextEnv]) -> list[_Live]:
    """Create and reset the environments of ``specs[indices]`` concurrently; each becomes a
    live episode holding its first prompt (or an infra error, already done)."""
    lives = [_Live(Episode(specs[i].episode_id, specs[i].group_id, specs[i].env, specs[i].task_id,
                           specs[i].seed, settings.horizon), None, index=i) for i in indices]

    def start(lv: _Live) -> tuple[Any, str | None]:
        spec = specs[lv.index]

        def _open() -> tuple[TextEnv, str, dict, list[dict[str, Any]] | None]:
            env = make_env(spec.env, **spec.env_kwargs)
            lv.env = env
            obs, info = env.reset(spec.task_id, spec.seed)
            return env, obs, info, checked_tools(env.tools())

        return _safe(_open)

    for lv, (res, err) in zip(lives, pool.map(start, lives)):
        if err:
            _fail(lv, err)
            continue
        env, obs, info, lv.tools = res
        system = settings.system_prompt if settings.system_prompt is not None else env.system_prompt()
        lv.system = system or None
        lv.head = formatter.start(lv.system, obs, tools=lv.tools)
        lv.ep.append(lv.head, sampled=False)
        lv.observation = obs
        lv.state = state_key(obs, info)
        if settings.context_policy == ContextPolicy.SUMMARY.value:
            summary, err = _safe(env.context_summary)
            if err:
                _fail(lv, err)
                continue
            lv.summaries.append(_required_summary(summary, env))
    return lives


def _ready(live: list[_Live], settings: RolloutSettings) -> list[_Live]:
    """The live episodes that take a turn now; one whose prompt leaves no room for a reply is
    truncated (done) instead."""
    fits = []
    for lv in live:
        if lv.done:
            continue
        if lv.prompt_len() + settings.max_new_tokens > settings.max_context_tokens:
            lv.ep.truncated = True  # the first prompt leaves no room for a reply
            lv.done = True
        else:
            fits.append(lv)
    return fits


def _play_turn(engine: InferenceEngine, formatter: ChatFormatter, pool: ThreadPoolExecutor,
               fits: list[_Live], settings: RolloutSettings, call: int) -> None:
    """One batched reply over ``fits`` (``generate``, or ``choose`` among the valid actions with
    ``constrain_actions``), then their environment steps, concurrently."""
    params = SamplingParams(
        max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
        top_p=settings.top_p, greedy=settings.greedy, choice_temperature=settings.action_temperature,
        stop_token_ids=formatter.end_of_turn_ids, stop_strings=list(settings.stop),
        seed=turn_seed(settings.seed, call),
    )
    choices: list[list[list[int]] | None] = [None] * len(fits)
    if settings.constrain_actions:
        listed = list(pool.map(lambda lv: _safe(lv.env.valid_actions), fits))
        for lv, (_, err) in zip(fits, listed):
            if err:
                _fail(lv, err)
        keep = [j for j, (_, err) in enumerate(listed) if not err]
        fits = [fits[j] for j in keep]
        choices = [[formatter.action_reply_ids(a, settings.stop) for a in listed[j][0]]
                   if listed[j][0] else None for j in keep]
    if settings.seeds_per_episode:  # one seed per reply: lv.turn is the turns taken so far
        params.row_seeds = [episode_turn_seed(settings.seed, lv.ep.episode_id, lv.turn) for lv in fits]
    samples = _replies(engine, fits, choices, params)
    replies = []
    renormalise = settings.action_logprob == RENORMALISED
    for lv, sample, cands in zip(fits, samples, choices):
        logprobs = sample.logprobs
        if renormalise and cands is not None:
            logprobs = _renormalised(sample, cands, settings.action_temperature)
            lv.ep.record_choice(cands)
        lv.ep.append(sample.token_ids, sampled=True, logprobs=logprobs)
        replies.append(formatter.reply_text(sample.token_ids))

    summarize = settings.context_policy == ContextPolicy.SUMMARY.value

    def step(j: int) -> tuple[tuple[StepResult, float, str] | None, str | None]:
        t0 = time.perf_counter()
        env = fits[j].env
        assert env is not None  # an episode without an environment failed at its start and is done
        res, err = _safe(lambda: checked_tool_step(checked(env.step(replies[j]))))
        latency = (time.perf_counter() - t0) * 1000.0
        if err or not summarize:
            return ((res, latency, "") if res else None), err
        summary, err = _safe(env.context_summary)
        return ((res, latency, summary) if not err else None), err

    for j, (out, err) in enumerate(pool.map(step, range(len(fits)))):
        lv = fits[j]
        turn, lv.turn = lv.turn, lv.turn + 1
        if err:
            _fail(lv, err)
            continue
        assert out is not None  # a step without an error has its result
        res, latency, summary = out
        if record_step(lv.ep, turn, settings.horizon, lv.observation, replies[j], res,
                       gen_tokens=len(samples[j].token_ids), latency_ms=latency, state=lv.state):
            lv.done = True
            continue
        glue = formatter.glue_step(res.observation, res.info, formatter.ends_turn(samples[j].token_ids))
        window = False
        if settings.context_policy != ContextPolicy.TRUNCATE.value:  # keep what a later segment copies
            lv.turn_ids.append(list(samples[j].token_ids) + glue)
            if summarize:
                lv.summaries.append(_required_summary(summary, lv.env))
            window = lv.turn - lv.seg_first_turn > settings.context_window
        # the next prompt: a new segment (the head and the last turns), or this one and the glue
        first, added = _next_segment(lv, formatter, settings) if window else (lv.seg_first_turn, glue)
        if (0 if window else lv.prompt_len()) + len(added) + settings.max_new_tokens > settings.max_context_tokens:
            # no room for the next observation and a reply: cut here, like the horizon
            lv.ep.truncated = lv.ep.turns[-1].truncated = True
            lv.done = True
            continue
        if window:
            lv.ep.context_starts.append(len(lv.ep.input_ids))
            lv.seg_start, lv.seg_first_turn = len(lv.ep.input_ids), first
        lv.ep.append(added, sampled=False)
        lv.observation = res.observation
        lv.state = state_key(res.observation, res.info)


def _required_summary(summary: str | None, env: TextEnv | None) -> str:
    """A state summary, which ``context_policy: summary`` requires: a configuration error (raised,
    not an episode's infra fault) where the environment provides none."""
    if summary is None or env is None:
        raise ValueError(f"rollout.context_policy=summary needs an environment with a state summary "
                         f"(TextEnv.context_summary); {getattr(env, 'name', env)!r} has none: use "
                         "rollout.context_policy: window")
    return summary


def _next_segment(lv: _Live, formatter: ChatFormatter, settings: RolloutSettings) -> tuple[int, list[int]]:
    """The episode's next context segment: its first kept turn and its ids, the head (window:
    the first prompt; summary: the system prompt and the state summary from before the kept
    turns) and the last ``context_window`` turns whole (appended as context, mask 0)."""
    first = lv.turn - settings.context_window
    head = lv.head if settings.context_policy == ContextPolicy.WINDOW.value else \
        formatter.start(lv.system, lv.summaries[first], tools=lv.tools)
    return first, head + [t for ids in lv.turn_ids[first:] for t in ids]


def _replies(engine: InferenceEngine, fits: list[_Live], choices: list[list[list[int]] | None],
             params: SamplingParams) -> list[Any]:
    """One reply per live episode: ``engine.choose`` among its candidates where it has some,
    ``engine.generate`` where it has none (two batched calls at most). ``params.row_seeds``,
    where given, holds one seed per episode of ``fits``; each call gets its rows' seeds."""
    out: list[Any] = [None] * len(fits)
    free = [j for j, c in enumerate(choices) if c is None]
    chosen = [(j, c) for j, c in enumerate(choices) if c is not None]

    def rows(js: list[int]) -> SamplingParams:
        seeds = params.row_seeds
        return params if seeds is None else replace(params, row_seeds=[seeds[j] for j in js])

    if free:
        got = engine.generate([fits[j].prompt() for j in free], rows(free),
                              cache_keys=[fits[j].ep.episode_id for j in free])
        for j, sample in zip(free, got):
            out[j] = sample
    if chosen:
        got = engine.choose([fits[j].prompt() for j, _ in chosen], [c for _, c in chosen],
                            rows([j for j, _ in chosen]),
                            cache_keys=[fits[j].ep.episode_id for j, _ in chosen])
        for (j, _), sample in zip(chosen, got):
            out[j] = sample
    return out


def _renormalised(sample: Any, candidates: list[list[int]], temperature: float = 1.0) -> list[float]:
    """A chosen reply's per-token log-probs renormalised over its candidates (``rollout.
    action_logprob: renormalised``) at the choice temperature ``rollout.action_temperature``,
    from the candidates' log-probs the engine scored them with."""
    if sample.choice_logprobs is None:
        raise ValueError("rollout.action_logprob=renormalised needs the engine's log-probs of every candidate "
                         "(Sample.choice_logprobs, which HFEngine.choose returns); this engine gave none")
    lps = [torch.tensor(x, dtype=torch.float64) for x in sample.choice_logprobs]
    return renormalised_logprobs(candidates, lps, choice_index(sample.token_ids, candidates), temperature).tolist()


def _finish(lv: _Live) -> Episode:
    """Close an ended episode's environment and settle its success flag."""
    if lv.env is not None:
        _safe(lv.env.close)
        lv.env = None
    if not lv.ep.infra_error and lv.ep.reward >= 1.0:
        lv.ep.success = True
    lv.ep.validate()
    return lv.ep


def checked(res: StepResult) -> StepResult:
    """``res`` if its reward is a finite number; else ``InfraError``. An environment that
    answers NaN or Inf is broken: clipping would make NaN a silent 0 (``max(0.0, nan)`` is 0.0)
    and Inf a success, both read as the policy's doing. As an infra error the episode is
    unscored and left out of every baseline, and enough of them stop the iteration
    (``rollout.max_infra_error_fraction``)."""
    try:
        reward = float(res.reward)
    except (TypeError, ValueError):
        raise InfraError(f"env returned a reward that is not a number: {res.reward!r}") from None
    if not math.isfinite(reward):
        raise InfraError(f"env returned a non-finite reward ({reward}); an environment's reward must "
                         "be a finite number in [0, 1]: the environment is broken, not the policy")
    return res


def checked_tool_step(res: StepResult) -> StepResult:
    """``res`` if its ``info["tool_results"]`` / ``info["tool_calls"]``, where present, have the
    shape ``env_adapters.tool_calls`` defines; else ``InfraError`` (the environment is broken:
    the rollout could not glue the results as tool messages)."""
    try:
        checked_tool_results(res.info)
    except ValueError as e:
        raise InfraError(f"env returned malformed tool results: {e}") from None
    return res


def state_key(observation: str, info: dict[str, Any] | None) -> str:
    """The key of the state an observation shows: the adapter's ``info["state_key"]`` (e.g.
    BabyAI's grid, pose and carried object), else a digest of the observation text."""
    key = (info or {}).get("state_key")
    if isinstance(key, str) and key:
        return key
    return "obs:" + hashlib.blake2b(observation.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()


def record_step(ep: Episode, turn: int, horizon: int, observation: str, reply: str, res: StepResult, *,
                gen_tokens: int, latency_ms: float, state: str | None = None) -> bool:
    """Book one environment step into ``ep`` (reward, ``Turn`` row, success, end flags); returns
    whether the episode ended (terminated, or truncated by the adapter or the horizon).
    ``state``: the key of the state the reply acted in (:func:`state_key` of ``observation`` and
    the info that came with it; default: of the observation alone)."""
    truncated = bool(res.truncated) or (turn + 1 == horizon and not res.terminated)
    # Most adapters reward the step; SciWorld-style ones report a running score. Either way the
    # turn records its own increment, so the turns' rewards add up to the episode outcome (what
    # turn-level credit assignment needs).
    checked(res)  # callers outside the rollout (demonstrations) get the same refusal
    running = ep.reward
    total = float(res.reward) if res.info.get("reward_is_cumulative") else running + float(res.reward)
    ep.reward = min(1.0, max(0.0, total))
    ep.turns.append(Turn(
        turn=turn, observation=observation, action_text=reply,
        parsed_action=res.info.get("parsed_action"), reward=ep.reward - running,
        terminated=bool(res.terminated), truncated=truncated,
        format_error=bool(res.info.get("format_error", False)),
        gen_tokens=gen_tokens, env_latency_ms=latency_ms,
        invalid_action=bool(res.info.get("invalid_action", False)),
        state_key=state or state_key(observation, None),
    ))
    if res.info.get("success"):
        ep.success = True
    if res.terminated or truncated:
        ep.terminated, ep.truncated = bool(res.terminated), truncated
        return True
    return False


def _fail(live: _Live, err: str) -> None:
    live.ep.infra_error = True
    live.ep.error = err
    # Not scored: NaN, never a 0 that would read as the policy's failure (pandas' mean skips
    # it; baselines, losses and metrics drop infra_error episodes explicitly).
    live.ep.reward = float("nan")
    live.ep.success = False
    live.done = True
