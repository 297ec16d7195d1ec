"""One RL iteration's library steps, held together by a ``PolicySession``.

A session owns what must stay in memory between iterations (tokenizer, inference engine,
DeepSpeed trainer) and the trajectory store. The Prefect tasks are thin wrappers over its
methods; each method takes and returns small, JSON-able values, and reads its inputs from
the store, so every step can be retried or resumed on its own.
"""

from __future__ import annotations

import random
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from agentgym import algorithms as A
from agentgym.chat import ChatFormatter
from agentgym.config import Estimator, PipelineConfig
from agentgym.batch import EpisodeBatch
from agentgym.context import merge_segments
from agentgym.gateway.agents import iter_played, run_played  # the `agent` kind plays through the gateway
from agentgym.models.folders import resolve_model
from agentgym.rewards.judge import GroupJudge
from agentgym.rollout.engines import engine_for
from agentgym.rollout.engines.base import InferenceEngine
from agentgym.rollout.loop import EpisodeSpec, RolloutSettings
from agentgym.schedule import stage_start, stage_tasks
from agentgym.store.trajectory_store import TrajectoryStore
from agentgym.training.batch import TrainBatch
from agentgym.training.protocol import Trainer, create_trainer
from agentgym.training.value_head import CRITIC_DIR
from agentgym.types import Episode, Turn
from env_adapters import make_env

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agentgym.cluster.rollout_pool import RolloutPool
    from agentgym.store.episode_writer import EpisodeWriter


def plan_episodes(cfg: PipelineConfig, global_step: int, eval_split: bool = False,
                  draw: int = 0, tasks: int | None = None) -> list[EpisodeSpec]:
    """The episodes of one iteration: a pure function of (config, global step, draw, tasks).

    ``draw`` > 0 is a further draw of dynamic sampling (``rollout.max_draws``): other tasks, group
    ids ending in ``-d<draw>``; ``tasks`` (default ``tasks_per_iteration``) is how many tasks
    it draws -- a further draw only replaces the groups that tied.

    ``tasks_per_iteration`` tasks are split across the environments in proportion to their
    weights (largest remainder, so a mixed batch always holds every environment its share
    allows), then drawn within each environment without replacement while possible; each task
    is played ``group_size`` times from the same initial state, which GRPO/RLOO compare. In
    training, an environment named in the stage's ``schedule.stages[].tasks`` draws from that
    subset (the stage is the global step's); held-out draws always use ``eval_tasks``.
    """
    rng = random.Random(f"{cfg.seed}:{global_step}:{'eval' if eval_split else 'train'}"
                        + (f":draw{draw}" if draw else ""))
    envs = [e for e in cfg.envs if (e.eval_tasks if eval_split else e.tasks)]
    if not envs:
        return []
    n = cfg.rollout.tasks_per_iteration if tasks is None else tasks
    subsets = {} if eval_split else stage_tasks(cfg.stages, global_step)
    total = sum(e.weight for e in envs)
    exact = [n * e.weight / total for e in envs]
    counts = [int(x) for x in exact]
    order = sorted(range(len(envs)), key=lambda k: (exact[k] - counts[k], rng.random()), reverse=True)
    for k in order[: n - sum(counts)]:
        counts[k] += 1
    picks: list[tuple[int, int]] = []
    for k, count in enumerate(counts):
        pool = list(envs[k].eval_tasks if eval_split else subsets.get(envs[k].name, envs[k].tasks))
        while count > 0:
            take = min(count, len(pool))
            picks.extend((k, t) for t in rng.sample(pool, take))
            count -= take
    specs = []
    for g, (k, task) in enumerate(picks):
        env = envs[k]
        group = f"s{global_step}-g{g}-{env.name}-{task}" + (f"-d{draw}" if draw else "")
        for i in range(cfg.rollout.group_size):
            specs.append(EpisodeSpec(env.name, task, cfg.seed, group, f"{group}-e{i}", dict(env.kwargs)))
    return specs


class InfraFailure(RuntimeError):
    """Too many of an iteration's episodes hit infrastructure errors: the setup is broken."""


@dataclass(frozen=True)
class EpisodeSummary:
    """What the iteration's metrics, dynamic sampling and the infra-error check need of one
    episode: a few numbers instead of its tokens and turn texts, so a streaming rollout keeps
    one of these per episode while the episodes themselves go to the store."""

    episode_id: str
    group_id: str
    env: str
    reward: float
    success: bool
    infra_error: bool
    error: str | None
    num_turns: int
    format_errors: int
    invalid_actions: int
    wasted: int  # turns that were a format error or an invalid action (``is_wasted``)

    @classmethod
    def of(cls, episode: Episode | EpisodeSummary) -> EpisodeSummary:
        if isinstance(episode, EpisodeSummary):
            return episode
        return cls(episode.episode_id, episode.group_id, episode.env, episode.reward,
                   episode.success, episode.infra_error, episode.error, episode.num_turns,
                   sum(t.format_error for t in episode.turns),
                   sum(t.invalid_action for t in episode.turns), wasted_turns(episode))


Episodes = Sequence[Episode | EpisodeSummary]


@dataclass
class _Played:
    """What one draw of an iteration's rollout leaves for its metrics (episodes are staged)."""

    summaries: list[EpisodeSummary]
    generated_tokens: float
    generate_s: float
    store_s: float


def check_infra_errors(episodes: Episodes, max_fraction: float, ref: IterationRef) -> None:
    """Raise ``InfraFailure`` when more than ``max_fraction`` of ``episodes`` are infra errors
    (all of them, whatever the setting), naming the distinct errors."""
    bad = [e for e in episodes if e.infra_error]
    if not bad or (len(bad) <= max_fraction * len(episodes) and len(bad) < len(episodes)):
        return
    errors = Counter(f"{e.env}: {e.error}" for e in bad)
    shown = "; ".join(f"{err} (x{n})" for err, n in errors.most_common(3))
    raise InfraFailure(
        f"stage {ref.stage} iteration {ref.iteration}: {len(bad)} of {len(episodes)} episodes hit "
        f"infrastructure errors (rollout.max_infra_error_fraction={max_fraction}); nothing was "
        f"committed. Errors: {shown}. Fix the environment setup (server address, env name, task "
        f"ids) and re-run with the same run id.")


def is_wasted(turn: Turn) -> bool:
    """Whether the turn's reply was a format error or named no available action."""
    return turn.format_error or turn.invalid_action


def wasted_turns(episode: Episode) -> int:
    """How many of the episode's turns were wasted (``is_wasted``)."""
    return sum(1 for t in episode.turns if is_wasted(t))


def episode_scores(episodes: Episodes, invalid_action_penalty: float = 0.0) -> torch.Tensor:
    """(B,) what the estimators compare: the episode reward, minus ``invalid_action_penalty``
    per wasted turn (``algorithm.invalid_action_penalty``)."""
    return torch.tensor([e.reward - invalid_action_penalty * EpisodeSummary.of(e).wasted
                         for e in episodes], dtype=torch.float32)


def tied_episodes(episodes: Episodes, invalid_action_penalty: float = 0.0) -> list[bool]:
    """Per scored episode (infra errors left out, in order): whether its group's scores
    (``episode_scores``) all tie -- no signal for GRPO / RLOO."""
    scored = [e for e in episodes if not e.infra_error]
    if not scored:
        return []
    return A.tied_groups(episode_scores(scored, invalid_action_penalty).double(),
                         [e.group_id for e in scored]).tolist()


def informative_groups(episodes: Episodes, invalid_action_penalty: float = 0.0) -> int:
    """Groups whose scored episodes do not all tie (GRPO / RLOO get a signal from them)."""
    scored = [e for e in episodes if not e.infra_error]
    tied = tied_episodes(scored, invalid_action_penalty)
    return len({e.group_id for e, t in zip(scored, tied) if not t})


def episode_metrics(episodes: Episodes) -> dict[str, float]:
    ok = [EpisodeSummary.of(e) for e in episodes if not e.infra_error]
    turns = sum(e.num_turns for e in ok)
    return {
        # every turn played, infra-failed episodes' too: what schedule.max_env_steps counts
        "env_steps": float(sum(EpisodeSummary.of(e).num_turns for e in episodes)),
        "reward_mean": float(np.mean([e.reward for e in ok])) if ok else float("nan"),
        "success_rate": float(np.mean([e.success for e in ok])) if ok else float("nan"),
        "turns_per_episode": float(np.mean([e.num_turns for e in ok])) if ok else float("nan"),
        "format_error_rate": sum(e.format_errors for e in ok) / turns if turns else float("nan"),
        "invalid_action_rate": sum(e.invalid_actions for e in ok) / turns if turns else float("nan"),
        "infra_error_episodes": float(len(episodes) - len(ok)),
        "episodes": float(len(episodes)),
    }


@dataclass
class IterationRef:
    stage: int
    iteration: int
    global_step: int


class PolicySession:
    def __init__(self, cfg: PipelineConfig, run_id: str, weights: str | Path | None = None):
        self.cfg = cfg
        self.run_id = run_id
        self.base_model = resolve_model(cfg.model.name_or_path, cfg.model.cache_dir)
        self.weights = Path(weights) if weights else self.base_model
        # Rollouts: the engine in this process, or (cfg.uses_ray) rollout workers as Ray actors,
        # each with its own engine; then this process holds the tokenizer alone.
        self._engine: InferenceEngine | None = None
        self.pool: RolloutPool | None = None
        self.tokenizer: PreTrainedTokenizerBase
        self._weight_sync: Any = None  # agentgym.cluster.weight_sync.WeightSync, at the first sync
        if cfg.uses_ray:
            from transformers import AutoTokenizer

            from agentgym.cluster.rollout_pool import RolloutPool

            self.pool = RolloutPool(cfg, str(self.weights))
            self.tokenizer = AutoTokenizer.from_pretrained(str(self.weights), local_files_only=True)
        else:
            self._engine, self.tokenizer = engine_for(cfg, self.weights)
        self.formatter = ChatFormatter(self.tokenizer, cfg.rollout.response_prefix)
        self.store = TrajectoryStore(cfg.store.root, run_id, cfg.store.storage_options)
        # reward.judge (agentgym.rewards.judge): None, the default, leaves every reward the environment's
        judge_cfg = cfg.reward.judge
        self.judge: GroupJudge | None = None if judge_cfg is None else GroupJudge.for_store(judge_cfg, self.store)
        self._trainer: Trainer | None = None
        # updates the trainer has made, and the version whose weights the engine serves (the two
        # differ between an update and the next weight sync: rollout.async_steps)
        self.policy_version = 0
        self.engine_version = 0
        # held while the trainer changes the weights and while they are copied to the engine: a
        # rollout played ahead (rollout.async_steps) syncs from another thread than the update
        self._weights_lock = threading.Lock()
        # global step -> policy_version once that step's update has finished (updated or not):
        # what a rollout ahead must have synced to at its start to keep staleness <= async_steps
        self._version_after: dict[int, int] = {}
        # (stage, iteration) -> {episode_id: critic values}: computed in the advantages step (GAE
        # needs them) and reused by that iteration's update as the value clip's reference. A
        # resumed update (no entry) recomputes them: the critic has not changed in between.
        self._old_values: dict[tuple[int, int], dict[str, list[float]]] = {}

    @property
    def engine(self) -> InferenceEngine:
        """The rollout engine in this process (none when rollout workers are Ray actors)."""
        if self._engine is None:
            raise RuntimeError("this session's rollouts run on Ray workers (ray.address / rollout.workers / "
                               "trainer.world_size): use play_episodes, not the engine")
        return self._engine

    def play_episodes(self, specs: list[EpisodeSpec], settings: RolloutSettings,
                      on_turn: Callable[[int, int], None] | None = None) -> list[Episode]:
        """Play ``specs`` with the current policy, nothing stored (evaluation): in this process,
        or over the rollout workers."""
        if self.pool is not None:
            return self.pool.play(specs, settings)
        return run_played(self.engine, self.formatter, specs, settings, make_env=make_env, on_turn=on_turn)

    @property
    def has_trainer(self) -> bool:
        """Whether the trainer was built (an evaluation-only session never builds one)."""
        return self._trainer is not None

    @property
    def trainer(self) -> Trainer:
        if self._trainer is None:  # built on first update: evaluation-only sessions skip it
            self._trainer = create_trainer(
                self.weights, self.tokenizer, self.cfg.trainer, self.cfg.algorithm,
                temperature=self.cfg.rollout.temperature, seed=self.cfg.seed,
                ray_cfg=self.cfg.ray if self.cfg.uses_ray else None,
                action_temperature=self.cfg.rollout.action_temperature,
            )
        return self._trainer

    def rollout_settings(self, horizon: int, seed: int, greedy: bool = False) -> RolloutSettings:
        return RolloutSettings.from_config(self.cfg, horizon, seed, greedy)

    # -- 1. rollout + store ----------------------------------------------------------------
    def collect(self, ref: IterationRef, horizon: int, on_turn=None) -> dict[str, Any]:
        """Play the iteration's episodes and commit them to the store, streaming.

        Episodes go to the store's ``EpisodeWriter`` as they end (``store.chunk_episodes`` per
        staged shard) and at most ``rollout.max_live_episodes`` play at once, so the rollout's
        memory does not grow with the number of episodes; only an ``EpisodeSummary`` per
        episode stays for the metrics. The commit is all-or-nothing: an exception (an
        ``InfraFailure``, a crashed engine) deletes the staged shards and commits nothing.
        """
        existing = self.store.manifest("episodes", ref.stage, ref.iteration)
        if existing is not None:  # already committed (resume): never roll out twice
            eps = self.store.read_episodes(ref.stage, ref.iteration, turn_text=False)
            return {"rows": existing.rows, "digest": existing.digest, "reused": True, **episode_metrics(eps)}
        t0 = time.perf_counter()
        summaries: list[EpisodeSummary] = []
        draws, gen, generate_s, store_s = 0, 0.0, 0.0, 0.0  # store_s: staging as episodes end
        wanted = self.cfg.rollout.tasks_per_iteration
        shaping = self.cfg.algorithm.invalid_action_penalty
        with self.store.episode_writer(stage=ref.stage, iteration=ref.iteration, global_step=ref.global_step,
                                       policy_version=self.engine_version,
                                       chunk_episodes=self.cfg.store.chunk_episodes) as writer:
            # dynamic sampling: draw again while too few groups carry a signal (max_draws 1: once);
            # a further draw plays only as many tasks as informative groups are still missing
            while draws < self.cfg.rollout.max_draws:
                missing = wanted - informative_groups(summaries, shaping) if draws else wanted
                if missing <= 0:
                    break
                seed = self.cfg.seed * 1_000_003 + ref.global_step + draws * 7_777_777
                specs = plan_episodes(self.cfg, ref.global_step, draw=draws, tasks=missing)
                settings = self.rollout_settings(horizon, seed=seed)
                played = (self._play_on_workers(specs, settings, writer, ref) if self.pool is not None
                          else self._play_here(specs, settings, writer, on_turn))
                summaries.extend(played.summaries)
                gen += played.generated_tokens
                generate_s += played.generate_s
                store_s += played.store_s
                draws += 1
            seconds = time.perf_counter() - t0
            check_infra_errors(summaries, self.cfg.rollout.max_infra_error_fraction, ref)
            t_commit = time.perf_counter()
            manifest = writer.commit()
            commit_s = time.perf_counter() - t_commit
        out = {
            "rows": manifest.rows, "digest": manifest.digest, "reused": False,
            "rollout_seconds": seconds, "generated_tokens": float(gen),
            # where the iteration's time goes (bench/pipeline_overhead.py adds these up)
            # (generate + store write + loop/env = rollout_seconds; the commit comes after it)
            "time/generate_s": generate_s, "time/rollout_store_write_s": store_s,
            "time/rollout_loop_env_s": seconds - generate_s - store_s, "time/rollout_store_commit_s": commit_s,
            "gen_tokens_per_s": gen / seconds if seconds > 0 else float("nan"),
            "sampling_draws": float(draws), "informative_groups": float(informative_groups(summaries, shaping)),
            **episode_metrics(summaries),
        }
        if self.pool is not None:
            out["rollout_workers"] = float(self.pool.size)
            out["rollout_worker_restarts"] = float(self.pool.restarts)
        return out

    def _play_here(self, specs: list[EpisodeSpec], settings: RolloutSettings, writer: EpisodeWriter,
                   on_turn: Callable[[int, int], None] | None) -> _Played:
        """One draw of ``collect`` on this process's engine, each episode staged as it ends."""
        tokens_before, gen_before = self.engine.generated_tokens, self.engine.generate_seconds
        summaries, store_s = [], 0.0
        for ep in iter_played(self.engine, self.formatter, specs, settings, make_env=make_env, on_turn=on_turn):
            t_add = time.perf_counter()
            writer.add(ep)
            store_s += time.perf_counter() - t_add
            summaries.append(EpisodeSummary.of(ep))
        return _Played(summaries, float(self.engine.generated_tokens - tokens_before),
                       self.engine.generate_seconds - gen_before, store_s)

    def _play_on_workers(self, specs: list[EpisodeSpec], settings: RolloutSettings, writer: EpisodeWriter,
                         ref: IterationRef) -> _Played:
        """One draw of ``collect`` over the rollout workers: each plays whole groups and stages
        its shards; ``writer`` adopts them all (the commit comes once, after every draw). Times:
        the slowest worker's generate / store seconds (the rollout's critical path)."""
        assert self.pool is not None
        where = {"stage": ref.stage, "iteration": ref.iteration, "global_step": ref.global_step,
                 "created_at": writer.created_at, "chunk_episodes": self.cfg.store.chunk_episodes}
        results = self.pool.collect(specs, settings, self.store.spec(), where)
        summaries: list[EpisodeSummary] = []
        for r in results:
            if r["version"] != self.engine_version:
                raise RuntimeError(f"a rollout worker played with policy version {r['version']}, "
                                   f"not the synced {self.engine_version}")
            writer.adopt(r["staged"], r["episode_ids"])
            summaries.extend(r["summaries"])
        return _Played(summaries, float(sum(r["generated_tokens"] for r in results)),
                       max((r["generate_s"] for r in results), default=0.0),
                       max((r["store_s"] for r in results), default=0.0))

    # -- 2. advantages ---------------------------------------------------------------------
    def advantages(self, ref: IterationRef) -> dict[str, Any]:
        """Advantages (and returns) of the iteration's committed episodes, committed as the
        ``advantages`` table. Depending on ``algorithm``: episode outcome or per-turn rewards
        (``credit``), a per-token KL penalty in the rewards (``kl_in_reward``: reference and, with
        ``recompute_old_logprobs``, current-policy log-probs from the trainer), and for ``gae``
        the critic's values (computed here, before the update, as GAE requires)."""
        algo = self.cfg.algorithm
        existing = self.store.manifest("advantages", ref.stage, ref.iteration)
        if existing is not None:
            return {"rows": existing.rows, "digest": existing.digest, "reused": True}
        t0 = time.perf_counter()
        episodes = [e for e in self.store.read_episodes(ref.stage, ref.iteration, turn_text=self.judge is not None)
                    if not e.infra_error]
        read_s = time.perf_counter() - t0
        if not episodes:
            manifest = self.store.write_advantages([], stage=ref.stage, iteration=ref.iteration,
                                                   estimator=algo.estimator.value)
            return {"rows": 0, "digest": manifest.digest, "reused": False, "tied_groups": 0.0}
        batch = EpisodeBatch.from_episodes(episodes)
        padded = batch.padded(self._pad_id())
        mask = padded.loss_mask
        extra: dict[str, float] = {}
        scored: list[Episode] = episodes
        if self.judge is not None:  # alpha x env + (1 - alpha) x judge; each group asked once (cached)
            judged = self.judge.judge_iteration(episodes, stage=ref.stage, iteration=ref.iteration,
                                                global_step=ref.global_step)
            scored, extra = judged.rescored(episodes), dict(judged.metrics)
        rewards = episode_scores(scored, algo.invalid_action_penalty)  # = rewards when unshaped
        groups = [e.group_id for e in episodes]
        gae = algo.estimator is Estimator.GAE
        need = ["values"] if gae else []
        if algo.kl_in_reward:
            need.append("ref_logprobs")
            if algo.recompute_old_logprobs:  # the update recomputes them the same way (same policy)
                need.append("logprobs")
        computed = self._compute(batch, padded, need) if need else {}
        penalty = torch.zeros_like(mask)
        if algo.kl_in_reward:
            old_lp = computed.get("logprobs", padded.old_logprobs)
            kl = A.kl_penalty(old_lp, computed["ref_logprobs"], algo.kl_estimator) * mask
            penalty = -algo.kl_coef * kl
            extra["kl"] = float(A.masked_mean(kl, mask))
        adv, ret = self._credit(episodes, rewards, penalty, mask, groups, computed.get("values"))
        if gae:
            values = computed["values"]
            extra["explained_variance"] = A.explained_variance(values, ret, mask)
            extra["value_mean"] = float(A.masked_mean(values, mask))
            extra["return_mean"] = float(A.masked_mean(ret, mask))
            valued = batch.with_columns(old_values=values)
            self._old_values[(ref.stage, ref.iteration)] = dict(zip(valued["episode_id"], valued["old_values"]))
        tied = A.tied_groups(rewards, groups)
        batch = batch.with_columns(advantages=adv, returns=ret)
        t_write = time.perf_counter()
        manifest = self.store.write_advantages(
            [{"episode_id": i, "advantages": a, "returns": r}
             for i, a, r in zip(batch["episode_id"], batch["advantages"], batch["returns"])],
            stage=ref.stage, iteration=ref.iteration, estimator=algo.estimator.value)
        write_s = time.perf_counter() - t_write
        extra["time/advantages_store_read_s"] = read_s
        extra["time/advantages_store_write_s"] = write_s
        extra["time/advantages_compute_s"] = t_write - t0 - read_s
        n_groups = len(set(groups))
        tied_groups = len({g for g, t in zip(groups, tied.tolist()) if t})
        adv_tokens = adv[mask.bool()]
        return {
            "rows": manifest.rows, "digest": manifest.digest, "reused": False,
            "tied_groups": float(tied_groups), "groups": float(n_groups),
            "adv_mean": float(adv_tokens.mean()) if adv_tokens.numel() else 0.0,
            "adv_std": float(adv_tokens.std()) if adv_tokens.numel() > 1 else 0.0,
            **extra,
        }

    def _credit(self, episodes: list[Episode], rewards: torch.Tensor, penalty: torch.Tensor, mask: torch.Tensor,
                groups: list[str], values: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages, returns), (B, T), by ``algorithm.credit`` and the estimator. ``penalty``:
        per-token reward terms (the KL in the rewards), added to whichever rewards are credited."""
        algo = self.cfg.algorithm
        if algo.credit != "turn":  # outcome: the episode's score on its last policy token
            token_rewards = A.place_outcome_reward(rewards, mask) + penalty
        else:
            turn_rewards, turn_mask = self._turn_rewards(episodes, algo.invalid_action_penalty)
            if algo.estimator is not Estimator.GAE:
                # group estimators and REINFORCE++: discounted turn returns against a turn-level baseline
                return A.turn_credit_advantages(
                    algo.estimator, turn_rewards + A.turn_sums(penalty, turn_mask, mask), turn_mask, mask, groups,
                    turn_gamma=algo.turn_gamma, baseline=algo.turn_baseline or "turn",
                    norm_by_std=algo.norm_adv_by_std, step_advantage_weight=algo.step_advantage_weight,
                    state_ids=self._state_ids(episodes, turn_mask.shape[1]) if algo.turn_baseline == "state" else None)
            # GAE: the critic bootstraps across turns, each turn's reward on its last token
            token_rewards = A.place_rewards_on_turn_ends(turn_rewards, turn_mask, mask) + penalty
        return A.compute_advantages(algo.estimator, token_rewards, mask, groups, values=values, gamma=algo.gamma,
                                    lam=algo.lam, norm_by_std=algo.norm_adv_by_std)

    def _compute(self, batch: EpisodeBatch, padded: TrainBatch, need: list[str]) -> dict[str, torch.Tensor]:
        """The trainer's per-token ``need`` (values, log-probs), (B, T) in the episode layout of
        ``batch`` (``padded``: its tensors): an episode with several context segments is computed
        one segment per row, as it is trained."""
        if not any(batch.columns.get("context_starts") or ()):
            return self.trainer.compute(padded, need)
        segments, spans = batch.segments()
        got = self.trainer.compute(segments.padded(self._pad_id()), need)
        shape = (padded.input_ids.shape[0], padded.input_ids.shape[1])
        return {k: merge_segments(v, spans, shape) for k, v in got.items()}

    def _pad_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    @staticmethod
    def _turn_rewards(episodes: list[Episode], invalid_action_penalty: float = 0.0
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, K) turn rewards and mask for ``credit=turn``: turn k of an episode is its k-th reply
        (one run of policy tokens), minus ``invalid_action_penalty`` if it was wasted. A turn whose
        reply sampled no token has no tokens to credit: its reward goes to the previous turn that
        has some."""
        K = max((len(e.turns) for e in episodes), default=0)
        r = torch.zeros(len(episodes), max(K, 1))
        m = torch.zeros(len(episodes), max(K, 1), dtype=torch.bool)
        for i, e in enumerate(episodes):
            last = None
            for k, t in enumerate(e.turns):
                reward = t.reward - (invalid_action_penalty if is_wasted(t) else 0.0)
                if t.gen_tokens > 0:
                    m[i, k], last = True, k
                    r[i, k] += reward
                elif last is not None:
                    r[i, last] += reward
        return r, m

    @staticmethod
    def _state_ids(episodes: list[Episode], K: int) -> torch.Tensor:
        """(B, K) ids of the state each turn acted in (its ``Turn.state_key``): equal keys, equal
        ids; for ``turn_baseline: state`` (GiGPO's step groups, formed within each group)."""
        ids: dict[str, int] = {}
        out = torch.zeros(len(episodes), max(K, 1), dtype=torch.long)
        for i, e in enumerate(episodes):
            for k, t in enumerate(e.turns):
                out[i, k] = ids.setdefault(t.state_key, len(ids))
        return out

    # -- 3. update + weight sync -----------------------------------------------------------
    def update(self, ref: IterationRef, sync: bool = True) -> dict[str, Any]:
        """PPO steps on the iteration's committed batch; ``sync``: then hand the new weights to
        the engine (False with ``rollout.async_steps``: a rollout may be playing on the old ones;
        :meth:`sync_if_behind` runs between rollouts). Refuses a batch sampled more than
        ``rollout.async_steps`` updates ago (metric ``staleness``)."""
        algo = self.cfg.algorithm
        sampled_by = self.store.read_table("episodes", stage=ref.stage, iteration=ref.iteration,
                                           columns=["policy_version"])["policy_version"]
        staleness = self.policy_version - int(sampled_by.min()) if len(sampled_by) else 0
        if staleness > self.cfg.rollout.async_steps:
            raise RuntimeError(
                f"iteration {ref.iteration} of stage {ref.stage} was sampled by policy version "
                f"{int(sampled_by.min())}, {staleness} updates before this one; rollout.async_steps="
                f"{self.cfg.rollout.async_steps} allows {self.cfg.rollout.async_steps} (a run resumed "
                "with a lower async_steps than it was rolled out with: resume it with the old value)")
        t_read = time.perf_counter()
        episodes = {e.episode_id: e for e in self.store.read_episodes(ref.stage, ref.iteration, turn_text=False)}
        adv = self.store.read_table("advantages", stage=ref.stage, iteration=ref.iteration)
        read_s = time.perf_counter() - t_read
        old_values = self._old_values.pop((ref.stage, ref.iteration), None)
        critic = algo.critic.model != "none"
        scored = [e for e in episodes.values() if not e.infra_error]
        flags = tied_episodes(scored, algo.invalid_action_penalty)
        tied = {e.episode_id for e, t in zip(scored, flags) if t}
        group_estimator = algo.estimator in (Estimator.GRPO, Estimator.RLOO)
        scored_rows = [] if adv.empty else [  # the advantages table's rows, in its order
            (i, a, r) for i, a, r in zip(adv["episode_id"], adv["advantages"], adv["returns"])
            if not episodes[i].infra_error]
        batch = EpisodeBatch.from_episodes(episodes[i] for i, _, _ in scored_rows).with_columns(
            advantages=[list(a) for _, a, _ in scored_rows])
        if critic:
            batch = batch.with_columns(returns=[list(r) for _, _, r in scored_rows])
            if old_values and all(i in old_values for i in batch["episode_id"]):
                batch = batch.with_columns(old_values=[old_values[i] for i in batch["episode_id"]])
            # else the trainer computes them before its first step
        # the row mask: a tied group has no signal, unless a KL penalty in the rewards gave it some
        keep = [not (algo.skip_tied_groups and group_estimator and i in tied and not any(a))
                for i, a in zip(batch["episode_id"], batch["advantages"])]
        skipped = keep.count(False)
        batch = batch.select(keep)
        if not len(batch):
            self._version_after[ref.global_step] = self.policy_version
            return {"updated": False, "skipped_episodes": float(skipped), "policy_version": self.policy_version,
                    "staleness": float(staleness)}
        t0 = time.perf_counter()
        seed = self.cfg.seed * 7919 + ref.global_step
        # One batch path at every world size: exactly this batch goes to the store's train_batch
        # table and the trainer (or each of a group's ranks) reads it back from there.
        self.store.write_train_batch(batch, stage=ref.stage, iteration=ref.iteration)
        write_s = time.perf_counter() - t0
        trainer = self.trainer  # built on the first update: its start-up is timed apart
        t_train = time.perf_counter()
        with self._weights_lock:  # a rollout ahead must not copy weights in the middle of a step
            metrics = trainer.train_from_store(self.store.spec(), ref.stage, ref.iteration, seed=seed)
            t_sync = time.perf_counter()
            self.policy_version += 1
            self._version_after[ref.global_step] = self.policy_version
            if sync:
                self.sync_weights()
        end = time.perf_counter()
        metrics = {**metrics, "time/update_store_read_s": read_s,
                   "time/train_batch_write_s": write_s, "time/trainer_start_s": t_train - t0 - write_s,
                   "time/train_s": t_sync - t_train, "time/weight_sync_s": end - t_sync}
        return {"updated": True, "update_seconds": end - t0,
                "skipped_episodes": float(skipped), "train_episodes": float(len(batch)),
                "policy_version": self.policy_version, "staleness": float(staleness), **metrics}

    def sync_weights(self) -> None:
        """Hand the trainer's current policy to the inference engine: merged full weights, or
        (vllm_server) the LoRA adapter, which the engine's servers load from a shared folder.
        With rollout workers: the full weights (LoRA merged) from training rank 0 to every
        worker over ``ray.weight_sync``'s channel, never through this process."""
        if self.pool is not None:  # from rank 0 over ray.weight_sync's channel (agentgym.cluster.weight_sync)
            from agentgym.cluster.trainer_group import RayTrainerGroup
            from agentgym.cluster.weight_sync import WeightSync

            trainer = self.trainer
            assert isinstance(trainer, RayTrainerGroup)  # create_trainer's choice whenever Ray is used
            if self._weight_sync is None:
                self._weight_sync = WeightSync(self.cfg.ray.weight_sync, self.cfg.ray.placement_timeout_s)
            self._weight_sync(trainer, self.pool, self.policy_version)
            self.engine_version = self.policy_version
            return
        if self.engine.syncs_adapters:
            self.engine.update_adapter(self.trainer.save_adapter)
        else:
            self.engine.update_weights(self.trainer.named_weights())
        self.engine_version = self.policy_version

    def retract_lost_work(self, from_step: int) -> list[int]:
        """After the checkpoint of global step ``from_step`` was restored (``policy_version`` set
        to the checkpoint's): withdraw what updates past that checkpoint produced, which the
        resumed run redoes and must not train on. Returns the global steps touched, ascending.

        * the episodes of a step >= ``from_step`` sampled by a policy version newer than the
          checkpoint's came from a policy that is gone: the iteration is retracted whole
          (episodes, turns, advantages, train batch) and will be rolled out again;
        * the advantages and train batch of a step > ``from_step`` were computed after a lost
          update (critic values, recomputed log-probs): retracted and recomputed; their episodes
          stay when the checkpoint's policy (or an older one, within ``rollout.async_steps``)
          sampled them.

        With a checkpoint after every iteration nothing is past the checkpoint but the
        iteration it was taken before (and, asynchronously, rollouts it sampled itself), so
        nothing is retracted. Retracted commits move under the store's ``_retracted/``."""
        stages = self.cfg.stages
        touched: dict[int, tuple[int, int]] = {}  # global step -> (stage, iteration)
        for m in self.store.commits("episodes"):
            step = stage_start(stages, m.stage) + m.iteration
            if step < from_step:
                continue
            sampled_by = self.store.read_table("episodes", stage=m.stage, iteration=m.iteration,
                                               columns=["policy_version"])["policy_version"]
            if len(sampled_by) and int(sampled_by.max()) > self.policy_version:
                self.store.retract(m.stage, m.iteration, ("train_batch", "advantages", "turns", "episodes"))
                touched[step] = (m.stage, m.iteration)
        for table in ("train_batch", "advantages"):
            for m in self.store.commits(table):
                step = stage_start(stages, m.stage) + m.iteration
                if step > from_step and step not in touched:
                    self.store.retract(m.stage, m.iteration, ("train_batch", "advantages"))
                    touched[step] = (m.stage, m.iteration)
        for key in touched.values():
            self._old_values.pop(key, None)
        return sorted(touched)

    def sync_if_behind(self, before_step: int | None = None) -> dict[str, float]:
        """Sync the weights if the trainer has updated since the engine's last sync. Call it only
        while no rollout plays: a sync inside a turn would mix two policies in one reply.

        ``before_step``: the global step whose rollout is about to start (``rollout.async_steps``
        k >= 1, which may call this while an update runs in another thread). If the engine
        already serves every update through step ``before_step - k - 1`` (the staleness bound
        holds for that rollout), it syncs only when no update is in progress and otherwise
        keeps the weights it has, so the rollout starts at once; if not, it waits for the
        update in progress to finish and syncs. ``None``: wait and sync to the latest.
        """
        t0 = time.perf_counter()
        wait = True
        if before_step is not None:
            need = self._version_after.get(before_step - self.cfg.rollout.async_steps - 1, 0)
            wait = self.engine_version < need
        if not self._weights_lock.acquire(blocking=wait):  # an update is in progress: play on
            return {"synced": 0.0, "time/weight_sync_s": 0.0, "time/weight_sync_wait_s": 0.0}
        try:
            t_locked = time.perf_counter()
            if self.engine_version >= self.policy_version:
                return {"synced": 0.0, "time/weight_sync_s": 0.0, "time/weight_sync_wait_s": t_locked - t0}
            self.sync_weights()
            return {"synced": 1.0, "time/weight_sync_s": time.perf_counter() - t_locked,
                    "time/weight_sync_wait_s": t_locked - t0}
        finally:
            self._weights_lock.release()

    def close(self) -> None:
        """Release the trainer (Ray rank actors stop), the rollout workers or engine, and the
        weight channel."""
        trainer, self._trainer = self._trainer, None
        if self.judge is not None:
            self.judge.close()
        if self._weight_sync is not None:
            self._weight_sync.close()
        try:
            if trainer is not None:
                trainer.close()
        finally:
            if self.pool is not None:
                self.pool.close()
            if self._engine is not None:
                self._engine.close()

    # -- 4. checkpoint ---------------------------------------------------------------------
    def export(self, out_dir: str | Path) -> Path:
        """Write the current policy as an HF folder (loads with ``from_pretrained``)."""
        if self._trainer is not None:
            return self._trainer.save_hf(out_dir, self.tokenizer)
        out = Path(out_dir)  # no update yet: the weights are the ones the session loaded
        out.mkdir(parents=True, exist_ok=True)
        for f in Path(self.weights).iterdir():
            if f.is_file():
                shutil.copy2(f, out / f.name)
            elif f.name == CRITIC_DIR and f.is_dir():  # a restored checkpoint's critic
                shutil.copytree(f, out / f.name, dirs_exist_ok=True)
        return out
