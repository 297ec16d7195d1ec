"""Typed configuration: one pydantic model per component, and PipelineConfig holding them all.

Every field has a default and a description (the Prefect UI renders them as a form). Unknown
fields are rejected, and cross-field checks say how to fix what they reject.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agentgym.config_base import _Strict
from agentgym.rewards.judge_config import RewardConfig
from env_adapters import ADAPTERS, is_known  # the name table only; adapters load on first use


def _form_note(note: str) -> Any:
    """A sentence added to a field's description in the run form only (not in docs/configuration.md)."""
    def edit(schema: dict[str, Any]) -> None:
        schema["description"] = f"{schema.get('description', '')} {note}".strip()

    return edit


def parse_task_ids(text: str) -> list[Any]:
    """The items of a task-id list written as one string, ``"0:40, 80, 90:100:2"`` (ids and
    ranges, comma-separated, optionally in brackets): ``[0:40, 80, 90:100:2]`` as list items."""
    inner = text.strip().removeprefix("[").removesuffix("]")
    items: list[Any] = []
    for part in inner.replace(",", " ").split():
        part = part.strip("'\"")
        items.append(int(part) if part.lstrip("-").isdigit() else part)
    return items


def expand_task_ranges(v: Any) -> Any:
    """A task-id list as written in a config -- ids, ``'start:stop[:step]'`` range strings, or the
    run form's one string ``"0:40, 80"`` -- with every range expanded into its ids (stop excluded).
    Anything else is returned as it is, for the field's own type check."""
    if isinstance(v, str):  # the run form's one-string form, "0:40, 80" (parse_task_ids)
        v = parse_task_ids(v)
    if not isinstance(v, list):
        return v
    out: list[Any] = []
    for item in v:
        if isinstance(item, str) and ":" in item:
            try:
                parts = [int(x) for x in item.split(":")]
                if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] <= 0):
                    raise ValueError
            except ValueError:
                raise ValueError(f"task range {item!r} is not 'start:stop' or 'start:stop:step' with "
                                 "integers and a positive step, e.g. '0:2000:40'") from None
            out.extend(range(*parts))
        else:
            out.append(item)
    return out


def compact_task_ids(ids: list[Any]) -> str:
    """A task-id list as one string :func:`parse_task_ids` reads back to the same ids, in the same
    order: runs of 3 or more consecutive ids as ``start:stop`` ranges, e.g. ``"0:3, 8, 40:43"``."""
    out: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        if isinstance(ids[i], int):
            while j + 1 < len(ids) and isinstance(ids[j + 1], int) and ids[j + 1] == ids[j] + 1:
                j += 1
        if j - i >= 2:
            out.append(f"{ids[i]}:{ids[j] + 1}")
        else:
            out.extend(str(x) for x in ids[i:j + 1])
        i = j + 1
    return ", ".join(out)


def _task_list_form(default: list[int]) -> Any:
    """The JSON schema of a task-id list field: one text input in the Prefect run form (``"0:40,
    80"``) instead of one box per id, or a list (an id list from a config file)."""
    def edit(schema: dict[str, Any]) -> None:
        schema.pop("type", None)
        schema.pop("items", None)
        schema["anyOf"] = [
            {"type": "string", "title": "ids and ranges",
             "description": "Comma-separated ids and start:stop[:step] ranges (stop excluded), e.g. 0:40, 80, 81."},
            {"type": "array", "title": "list",
             "items": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string"}]}},
        ]
        schema["default"] = compact_task_ids(default)

    return edit


class Estimator(str, Enum):
    """Advantage estimator (``algorithm.estimator``)."""

    GRPO = "grpo"
    RLOO = "rloo"
    REINFORCE_PP = "reinforce_pp"
    GAE = "gae"


class ContextPolicy(str, Enum):
    """What the policy sees of a long conversation (``rollout.context_policy``; agentgym.context)."""

    TRUNCATE = "truncate"
    WINDOW = "window"
    SUMMARY = "summary"


#: a reply's token budget unless configured (``rollout.max_new_tokens``; the engines' default too)
DEFAULT_MAX_NEW_TOKENS = 48


class ModelConfig(_Strict):
    name_or_path: str = Field(
        "tiny",
        description="'tiny' (test model built locally), 'smollm2' (packaged SmolLM2-135M-Instruct) "
        "or a path to a local Hugging Face model folder.",
    )
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="Weights dtype of the rollout engine. auto: bfloat16 where the hardware has "
        "bf16 arithmetic (CUDA, or a CPU with AVX512-BF16 / AMX), else float32 (emulated bf16 is slower "
        "than fp32 on a CPU without them; see agentgym/models/hardware.py)."
    )
    cache_dir: str = Field(
        "~/.cache/agentgym/models", description="Where prepared models (tiny, smollm2) are cached."
    )


class EnvSpec(_Strict):
    name: str = Field(
        "babyai", description="Environment adapter name (see env_adapters.ADAPTERS), or the import path "
        "of your own TextEnv subclass, package.module:Class.")
    tasks: list[int] = Field(
        default_factory=lambda: list(range(8)),
        description="Training task ids (AgentGym data_idx) this environment draws from. Items are "
        "ids or Python-style ranges as strings, 'start:stop' or 'start:stop:step' (stop excluded): "
        "'0:2000:40' is BabyAI level 1 with minigrid seeds 0-49.",
        json_schema_extra=_task_list_form(list(range(8))),
    )
    eval_tasks: list[int] = Field(
        default_factory=list, description="Held-out task ids for evaluation (empty: no eval); ids or "
        "'start:stop[:step]' ranges as in tasks.",
        json_schema_extra=_task_list_form([]),
    )
    weight: float = Field(1.0, gt=0, description="Share of each rollout batch in a mixed config.")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the adapter constructor. "
        "name: http (a remote AgentGym server) takes base_url (one server) or base_urls (a pool of "
        "servers of the same environment: each episode goes to the live one with the fewest open "
        "instances, a dead one is skipped until its /health check passes again, every "
        "health_interval_s seconds, default 5), env_name, dialect, timeout_s, retries. name: miniwob "
        "(MiniWoB++ in headless Chromium) takes families (the task families task ids cycle through; "
        "default the adapter's list, which task categories assume), time_limit_s (MiniWoB's page clock; "
        "default none), data_mode, chromium and chromedriver (paths; default from PATH)."
    )

    @field_validator("tasks", "eval_tasks", mode="before")
    @classmethod
    def _expand_ranges(cls, v: Any) -> Any:
        return expand_task_ranges(v)

    @field_validator("tasks")
    @classmethod
    def _non_empty(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("tasks is empty; list at least one task id, e.g. tasks: [0, 1, 2]")
        return v

    @field_validator("tasks", "eval_tasks")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        bad = [t for t in v if t < 0]
        if bad:
            raise ValueError(f"task ids are AgentGym data_idx values, 0 or more; got {bad[:5]}")
        return v

    @model_validator(mode="after")
    def _agent_entrypoint(self) -> "EnvSpec":
        """An agent environment (name: agent) names its entrypoint."""
        if self.name == "agent" and not isinstance(self.kwargs.get("entrypoint"), str):
            raise ValueError("envs[].name=agent needs kwargs.entrypoint, the agent's package.module:function "
                             "called as run(base_url, task); e.g. kwargs: {entrypoint: examples.openai_agent:run}")
        return self

    @model_validator(mode="after")
    def _remote_servers(self) -> "EnvSpec":
        """A remote environment (name: http) names its server(s) and its environment."""
        if self.name != "http":
            return self
        one, many = self.kwargs.get("base_url"), self.kwargs.get("base_urls")
        example = ("e.g. kwargs: {base_urls: [http://10.0.0.5:8001, http://10.0.0.6:8001], "
                   "env_name: babyai}")
        if (one is None) == (many is None):
            raise ValueError("envs[].name=http needs kwargs.base_url (one server) or kwargs.base_urls "
                             f"(a pool of servers of the same environment), exactly one; {example}")
        if many is not None:
            if (not isinstance(many, list) or not many
                    or not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in many)):
                raise ValueError(f"envs[].kwargs.base_urls must be a non-empty list of http(s) URLs, "
                                 f"got {many!r}; {example}")
            if len({u.rstrip("/") for u in many}) != len(many):
                raise ValueError(f"envs[].kwargs.base_urls lists a server twice ({many}); list each once "
                                 "(episodes are spread by load, so a server needs no second entry)")
        if not self.kwargs.get("env_name"):
            raise ValueError(f"envs[].name=http needs kwargs.env_name (the environment's name in the "
                             f"trajectory store and its task categories); {example}")
        return self

    @field_validator("name")
    @classmethod
    def _known_env(cls, v: str) -> str:
        if not is_known(v):
            raise ValueError(f"unknown environment {v!r}; choose one of {sorted(ADAPTERS)}, your "
                             "adapter's import path (package.module:Class), or name: http with kwargs "
                             "base_url, env_name for a remote AgentGym server")
        return v


class RolloutConfig(_Strict):
    engine: Literal["hf", "vllm", "vllm_server"] = Field(
        "hf", description="Inference engine for rollouts. hf: transformers in this process; vllm: vLLM "
        "in this process (.venv-vllm); vllm_server: remote `vllm serve` endpoints (rollout.servers), "
        "weights synced as LoRA adapters (needs trainer.lora).")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the hf engine's model runs: auto: the first CUDA GPU when there "
        "is one (beside the trainer, whose weights it receives), else the CPU. vLLM places its own "
        "model (leave auto).")
    servers: list[str] = Field(
        default_factory=list,
        description="vllm_server: base URLs of the `vllm serve` endpoints (http://host:port), all "
        "serving model.name_or_path's weights; requests go to the live one with the fewest in flight. "
        "Start each with `python -m agentgym.rollout.engines.vllm_server_launch MODEL_DIR --enable-lora "
        "--max-lora-rank R ...` (see docs/scale-out.md) and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True.")
    served_model: str | None = Field(
        None, description="vllm_server: the model name the servers serve (vllm serve's "
        "--served-model-name). None: the one base model they list under /v1/models (the same on all).")
    server_timeout_s: float = Field(
        300.0, gt=0, description="vllm_server: seconds one completion request may take before it "
        "counts as failed (and is retried on another server).")
    server_retries: int = Field(
        2, ge=0, description="vllm_server: further tries of a request that timed out, could not connect "
        "or got HTTP 5xx; when they are spent generate raises InfraError and the iteration's rollout fails "
        "before its commit (nothing stored; the collect task's retry rolls it out again).")
    adapter_dir: str | None = Field(
        None, description="vllm_server: folder the trainer writes each LoRA adapter version to and the "
        "servers load it from, at the same path (a shared filesystem for remote servers). None: a "
        "private temp folder, right only for servers on this host.")
    tasks_per_iteration: int = Field(4, ge=1, description="Distinct tasks sampled per iteration.")
    group_size: int = Field(
        4, ge=1, description="Episodes per task (G); GRPO/RLOO baselines are computed within a group."
    )
    max_new_tokens: int = Field(DEFAULT_MAX_NEW_TOKENS, ge=1, description="Token budget of one reply.")
    max_context_tokens: int = Field(
        4096, ge=64, description="An episode whose next prompt would exceed this is truncated."
    )
    context_policy: ContextPolicy = Field(
        ContextPolicy.TRUNCATE,
        description="What the policy sees once a conversation grows long. truncate: the whole "
        "conversation; the episode ends when the next prompt would exceed max_context_tokens. window: "
        "the system prompt, the first observation and the last context_window turns. summary: the "
        "system prompt, the environment's state summary from before the kept turns "
        "(TextEnv.context_summary: BabyAI, TextCraft) and the last context_window turns. With window "
        "and summary every turn is trained under exactly the context it was sampled under (the "
        "episode stores each new context as a segment: Episode.context_starts).",
    )
    context_window: int = Field(
        4, ge=1, description="Turns kept whole by context_policy window and summary.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (log-probs use it too).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    response_prefix: str = Field(
        "",
        description="Text forced at the start of every reply (not trained on), e.g. 'Action:' to "
        "help a small model keep the action format.",
    )
    stop: list[str] = Field(
        default_factory=list, description="Stop strings; the reply ends after the first match."
    )
    env_workers: int = Field(
        64, ge=1,
        description="Threads stepping environments concurrently: up to this many live episodes "
        "step (and reset) at once, the rest wait for a thread. A thread waiting on an environment "
        "(a simulator, an HTTP env server) costs no CPU, so it should cover the live episodes "
        "(bench/env_concurrency.py measures the speed-up). Only min(env_workers, live episodes) "
        "threads are made. "
        "Lower it for environments that cannot take that many concurrent calls.",
    )
    constrain_actions: bool = Field(
        False,
        description="Action-constrained decoding (as GLAM): where an environment lists its valid "
        "actions, the reply is one of them, written in the reply format (response_prefix, stop) and "
        "drawn with probability proportional to the policy's probability of saying it at "
        "temperature (greedy: the likeliest); the stored tokens and log-probs are that reply's, as if "
        "sampled. Where no list is given (valid_actions() is None) the reply is generated freely. "
        "Applies to training rollouts and held-out evaluation alike. Costs one extra forward per "
        "turn over the candidates. Engine hf only.",
    )
    action_logprob: Literal["policy", "renormalised"] = Field(
        "policy",
        description="With constrain_actions, which log-prob of a constrained reply the PPO ratio "
        "uses. policy: the policy's own per-token log-probs of the reply, log pi(a|s), as free "
        "sampling would report them; the ratio and its gradient leave out the normaliser log Z(s) "
        "= log sum over the valid actions c of pi(c|s), which moves with the weights too (exact only "
        "when a group's turns share a state). renormalised: the log-prob of the distribution the "
        "reply was drawn from, log pi(a|s) - log Z(s), spread over the reply's tokens along the "
        "candidates' token tree (a token all candidates through it share gets log-prob 0: ratio 1, "
        "no gradient, never clipped); the episode stores the turn's candidates (episodes."
        "action_candidates) and the trainer recomputes Z under the current weights, with its "
        "gradient, by scoring the candidates in the same forward as the conversation (a token tree "
        "per turn). Costs the candidates' distinct tokens as extra forward/backward tokens "
        "(docs/architecture.md has the measured cost). Needs constrain_actions. On the quickstart's BabyAI recipe (3 "
        "seeds each) it was level with policy within a wide interval, so policy stays the default "
        "(docs/results.md).",
    )
    action_temperature: float = Field(
        1.0, gt=0,
        description="With action_logprob: renormalised, the temperature of the choice among a turn's "
        "listed actions: a reply is drawn with probability proportional to q(a|s)^(1/action_temperature), "
        "q the policy renormalised over the candidates, and the trainer's log-probs are those of that "
        "same distribution (the PPO ratio stays exact; greedy evaluation is unchanged). Above 1 it "
        "explores whole commands: the per-token temperature multiplies through every token of a "
        "command, so raising it shifts mass to the shortest commands (docs/results.md, Table 1). "
        "1.0: the choice is q itself.",
    )
    max_live_episodes: int = Field(
        256, ge=1,
        description="At most this many episodes play at once; when some end, the next ones start "
        "in their place (each generate batches episodes at different turns). Bounds the rollout's "
        "memory (token lists, KV caches, open environments) independently of the number of "
        "episodes per iteration; with fewer episodes than this all play together, as one batch.",
    )
    max_draws: int = Field(
        1, ge=1,
        description="Dynamic sampling (DAPO / verl filter_groups): when fewer than tasks_per_iteration "
        "of an iteration's groups are informative (rewards not all tied, so GRPO/RLOO have a "
        "signal), draw and play as many further tasks as informative groups are missing, up to "
        "max_draws draws in all. 1: off. Every drawn episode is committed; tied groups are skipped "
        "by the update as always. "
        "Metrics: sampling_draws, informative_groups.",
    )
    max_infra_error_fraction: float = Field(
        0.5, ge=0, le=1,
        description="Fail the iteration (before committing it, so a re-run rolls it out again) when "
        "more than this share of its episodes hit infrastructure errors (dead env server, unknown "
        "environment, bad task id): a broken setup stops the run instead of training on what is left. "
        "1.0: never fail (the unscored episodes are just left out).",
    )
    async_steps: int = Field(
        0, ge=0, le=8,
        description="Asynchronous RL with bounded staleness k (one-step off-policy as verl's recipe "
        "at k = 1): the rollouts of the next k iterations play, one after another on the engine, "
        "while this iteration's advantages and update run, each with the weights synced at its "
        "start, so an update trains on episodes sampled by a policy at most k updates older; the "
        "PPO ratio is taken against the sampler's stored log-probs, which keeps the clipped "
        "objective correct off-policy. Weights are synced between rollouts, never inside one: a "
        "rollout that would start more than k updates behind waits for the update in progress. "
        "A stage's first iteration is synchronous (no rollout at a new horizon before its stage). "
        "0: synchronous.",
    )
    workers: int = Field(
        1, ge=1,
        description="Rollout workers. 1 with trainer.world_size 1 and ray.address null: the engine "
        "plays in the flow's process. N > 1 (or any ray.address): N Ray actors, each with its own "
        "engine (rollout.engine) and environments; an iteration's GRPO groups are split between them "
        "(a group stays on one worker), each stages its shards and the flow commits one manifest. "
        "Weights reach every worker from training rank 0 through Ray's object store.",
    )
    sampling_seeds: Literal["auto", "per_call", "per_episode"] = Field(
        "auto",
        description="How sampling is seeded. per_episode: every (episode, turn) has its own seed, so "
        "an episode samples the same reply whichever batch or worker it plays in (1 and N workers "
        "play the same episodes). per_call: one seed per batched generate call (the sampling of every "
        "result recorded before rollout.workers existed, the quickstart's included). auto: "
        "per_episode when rollout.workers > 1, else per_call.",
    )

    @model_validator(mode="after")
    def _choice_engine(self) -> "RolloutConfig":
        if self.constrain_actions and self.engine != "hf":
            raise ValueError("rollout.constrain_actions is implemented by the hf engine only; set "
                             "rollout.engine: hf or rollout.constrain_actions: false")
        if self.action_logprob == "renormalised" and not self.constrain_actions:
            raise ValueError("rollout.action_logprob=renormalised renormalises each reply over the valid "
                             "actions it was drawn among, which only rollout.constrain_actions draws from; "
                             "set rollout.constrain_actions: true, or rollout.action_logprob: policy")
        if self.action_temperature != 1.0 and self.action_logprob != "renormalised":
            raise ValueError(f"rollout.action_temperature={self.action_temperature} tempers the choice among "
                             "the listed actions, whose log-prob only rollout.action_logprob: renormalised "
                             "trains on; set rollout.constrain_actions: true and rollout.action_logprob: "
                             "renormalised, or rollout.action_temperature: 1.0")
        if self.device != "auto" and self.engine != "hf":
            raise ValueError(f"rollout.device={self.device} applies to the hf engine only (rollout.engine="
                             f"{self.engine} places its own model); leave rollout.device: auto")
        if self.engine == "vllm_server":
            if not self.servers:
                raise ValueError("rollout.engine=vllm_server needs rollout.servers, the base URLs of "
                                 "the `vllm serve` endpoints, e.g. [http://127.0.0.1:8000]")
            bad = [u for u in self.servers if not u.startswith(("http://", "https://"))]
            if bad:
                raise ValueError(f"rollout.servers {bad} are not http(s):// base URLs; write them as "
                                 "http://host:port")
            if self.adapter_dir and "://" in self.adapter_dir:
                raise ValueError(
                    f"rollout.adapter_dir={self.adapter_dir!r}: vLLM 0.32 loads LoRA adapters from a "
                    "local path (or a Hugging Face Hub id) only, so the servers cannot read object "
                    "storage; use a folder on a filesystem shared with the servers (e.g. an NFS or "
                    "s3fs mount), or null for servers on this host")
        elif self.servers:
            raise ValueError(f"rollout.servers is set but rollout.engine={self.engine}; set "
                             "rollout.engine: vllm_server or servers: []")
        return self


class CriticConfig(_Strict):
    """The learned value function V(prefix) of PPO (estimator gae): trained with the clipped
    value loss on the returns GAE computes from its own values before each update."""

    model: Literal["none", "separate", "shared"] = Field(
        "none",
        description="none: no critic (grpo, rloo, reinforce_pp). separate: a value model built from "
        "the same base as the policy (its transformer plus a linear value head), with its own "
        "DeepSpeed engine and AdamW; costs a second model's memory; trains all its weights even "
        "with trainer.lora. shared: a linear value head on the policy's last hidden states; the "
        "value loss (x value_loss_coef) joins the policy loss in the policy's optimizer, so the "
        "trunk learns from both. Exports write the critic beside the policy, in critic/.",
    )
    learning_rate: float = Field(
        1e-5, gt=0,
        description="AdamW learning rate of the critic (separate: its whole model; shared: the value "
        "head only, the trunk keeps trainer.learning_rate). Constant: trainer.lr_schedule does "
        "not apply to a separate critic; a shared head follows the policy's schedule.",
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay of the critic's parameters.")
    grad_clip: float = Field(
        1.0, gt=0, description="separate: gradient norm clip of the critic (shared: trainer.grad_clip)."
    )
    value_clip: float | None = Field(
        0.5, gt=0,
        description="PPO value clipping: the loss takes the larger of (V - R)^2 and (V_clip - R)^2 "
        "with V_clip = V_old + clamp(V - V_old, -value_clip, value_clip); null disables it. In "
        "reward units (episode rewards are in [0, 1]).",
    )
    value_loss_coef: float = Field(
        0.5, gt=0,
        description="Weight of the value loss 0.5 * agg((V - R)^2) (aggregated like "
        "algorithm.loss_agg). shared: loss = policy loss + value_loss_coef * value loss; separate: "
        "scales the critic's own loss (AdamW is nearly invariant to it; it matters against grad_clip).",
    )


class AlgorithmConfig(_Strict):
    estimator: Estimator = Field(
        Estimator.GRPO,
        description="Advantage estimator: grpo / rloo (group baselines over rollout.group_size "
        "samples of a task), reinforce_pp (batch-whitened returns), gae (PPO with a learned critic: "
        "needs critic.model).",
    )
    norm_adv_by_std: bool = Field(
        True, description="GRPO: divide by the group std (False gives Dr. GRPO)."
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount for gae / reinforce_pp.")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda.")
    clip_low: float = Field(0.2, ge=0, description="PPO ratio clip below 1 (1 - clip_low).")
    clip_high: float = Field(0.28, ge=0, description="PPO ratio clip above 1 (clip-higher).")
    dual_clip: float | None = Field(
        None, description="Dual-clip constant c > 1 for negative advantages; None disables."
    )
    kl_coef: float = Field(
        0.0, ge=0,
        description="Weight of the KL to the reference (the initial policy, kept frozen): a loss "
        "term, or a per-token reward penalty with kl_in_reward. 0: no reference model is built.",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator.")
    entropy_coef: float = Field(0.0, description="Entropy bonus weight (subtracted from the loss).")
    loss_agg: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = Field("token-mean", description="How token losses are aggregated.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each rollout batch.")
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per pass.")
    skip_tied_groups: bool = Field(
        True, description="Drop groups whose rewards all tie (zero advantage, no signal)."
    )
    credit: Literal["outcome", "turn"] = Field(
        "outcome",
        description="outcome: the episode reward sits on its last policy token and the estimator "
        "spreads it (grpo/rloo: one advantage per episode). turn: each turn's own reward is used: "
        "grpo/rloo/reinforce_pp give the tokens of turn k the return G_k = sum_{j>=k} "
        "turn_gamma^(j-k) r_j of the turn rewards from k on, minus the estimator's baseline (grpo: "
        "group mean / std of the episode outcomes; rloo: leave-one-out mean of the outcomes; "
        "reinforce_pp: whitened over the batch); gae puts each turn's reward on that turn's last "
        "policy token and lets the critic assign credit.",
    )
    invalid_action_penalty: float = Field(
        0.0, ge=0,
        description="Reward shaping for the update only: subtract this for every turn whose reply "
        "was a format error or named no available action. credit=outcome: from the episode's score "
        "(so among episodes that all fail, those that repeated invalid actions rank below the rest "
        "and the group still carries a signal); credit=turn: from that turn's reward. Success, "
        "reward_mean and the stored rewards are unchanged; dynamic sampling counts the shaped "
        "scores. 0: off.",
    )
    turn_gamma: float = Field(
        1.0, ge=0, le=1,
        description="credit=turn with grpo/rloo/reinforce_pp: discount per TURN (not per token). 1 "
        "gives turn k the reward still to come; lower values favour a turn's near rewards.",
    )
    turn_baseline: Literal["outcome", "turn", "state"] | None = Field(
        None,
        description="credit=turn with grpo/rloo/reinforce_pp: what G_k is compared with (None: turn). turn: "
        "the estimator's statistics of the returns G_k at the same turn index k (grpo/rloo: over the "
        "group's episodes that reached turn k; reinforce_pp: centred per turn index over the batch, "
        "then whitened). outcome: the statistics of the episode outcomes (later turns, whose G_k "
        "leaves out earlier rewards, then sit below the baseline on average). state (grpo/rloo "
        "only): GiGPO's step groups: the turns of a group taken from the same environment state "
        "(the adapter's info['state_key'], else the observation text) are compared with each "
        "other, and the turn's advantage is the episode's outcome advantage plus "
        "step_advantage_weight x its deviation within the step group; GiGPO uses turn_gamma 0.95, "
        "so a success reached sooner from the same state scores higher.",
    )
    step_advantage_weight: float = Field(
        1.0, ge=0,
        description="turn_baseline=state: the weight of the step advantage added to the episode "
        "advantage (GiGPO's omega; 0 leaves the episode advantage alone).",
    )
    kl_in_reward: bool = Field(
        False,
        description="False: KL to the reference is a loss term (kl_coef x KL of the current "
        "policy). True: it is a reward penalty instead: every policy token gets reward "
        "-kl_coef x KL(pi_old || pi_ref) (kl_estimator) before the estimator runs (grpo/rloo "
        "score the episode's penalised sum); the KL loss term is then off. Needs kl_coef > 0.",
    )
    recompute_old_logprobs: bool = Field(
        False,
        description="False: the PPO ratio's old log-probs are the rollout engine's sampling "
        "log-probs. True: recompute them with the trainer's current policy (dropout off) before "
        "the first epoch, removing engine/trainer numeric mismatch (bf16 kernels, vLLM) from the "
        "ratio, at one extra forward pass over the batch; metric old_logprob_abs_diff.",
    )
    critic: CriticConfig = Field(
        default_factory=CriticConfig, description="The value function (estimator gae only)."
    )

    @model_validator(mode="after")
    def _check(self) -> "AlgorithmConfig":
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 (got {self.dual_clip}); use e.g. 3.0 or null")
        gae = self.estimator is Estimator.GAE
        if gae and self.critic.model == "none":
            raise ValueError(
                "algorithm.estimator=gae needs a critic: set algorithm.critic.model to 'separate' (a "
                "value model from the same base, its own optimizer) or 'shared' (a value head on the "
                "policy), or use a critic-free estimator (grpo, rloo, reinforce_pp)"
            )
        if not gae and self.critic.model != "none":
            raise ValueError(
                f"algorithm.critic.model={self.critic.model} but estimator={self.estimator.value} "
                "uses no critic; set algorithm.estimator: gae, or algorithm.critic.model: none"
            )
        if self.kl_in_reward and self.kl_coef <= 0:
            raise ValueError(
                "algorithm.kl_in_reward=true needs algorithm.kl_coef > 0 (the penalty per token is "
                "-kl_coef x KL); set kl_coef (e.g. 0.01) or kl_in_reward: false"
            )
        if self.turn_baseline is not None and (self.credit == "outcome" or gae):
            raise ValueError(
                f"algorithm.turn_baseline={self.turn_baseline} is only used by credit: turn with grpo, "
                "rloo or reinforce_pp; set credit: turn with one of those, or remove turn_baseline"
            )
        if self.turn_baseline == "state" and self.estimator not in (Estimator.GRPO, Estimator.RLOO):
            raise ValueError(
                f"algorithm.turn_baseline=state (GiGPO's step groups) compares episodes within a group: "
                f"set estimator: grpo or rloo (not {self.estimator.value}), or use turn_baseline: turn"
            )
        if self.step_advantage_weight != 1.0 and self.turn_baseline != "state":
            raise ValueError(
                f"algorithm.step_advantage_weight={self.step_advantage_weight} is only used by "
                "turn_baseline: state; set turn_baseline: state (with credit: turn), or remove it"
            )
        if self.turn_gamma != 1.0 and (self.credit == "outcome" or gae):
            raise ValueError(
                f"algorithm.turn_gamma={self.turn_gamma} is only used by credit: turn with grpo, "
                "rloo or reinforce_pp (gae discounts per token with gamma); set credit: turn with "
                "one of those, or leave turn_gamma at 1.0"
            )
        return self


class LoraSettings(_Strict):
    """LoRA adapters through peft: only the adapters train; the inference engine gets merged weights."""

    r: int = Field(8, ge=1, description="Adapter rank.")
    alpha: float = Field(16.0, gt=0, description="Adapter scale numerator (the update is alpha / r * B A).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input while training.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="Module names that get adapters, e.g. [q_proj, v_proj]; 'all-linear' adapts every "
        "linear layer except the output head.",
    )
    modules_to_save: list[str] = Field(
        default_factory=list,
        description="Modules trained in full beside the adapters (peft's modules_to_save), e.g. "
        "[norm] for the RMSNorm weights: with tied embeddings the final norm is what lets the logits "
        "grow. Leave out tied embeddings / lm_head (their merged export would untie them).",
    )


class TrainerConfig(_Strict):
    learning_rate: float = Field(1e-5, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clip.")
    max_nonfinite_skips: int = Field(
        3, ge=1,
        description="An optimizer step whose loss or gradient is not finite (NaN/Inf) is skipped: "
        "weights, AdamW moments and the learning-rate schedule stay as they were, and the metric "
        "nonfinite_skips counts it. This many skipped steps in a row stop training with "
        "NonFiniteTrainingError (the count restarts at the next applied step).")
    zero_stage: Literal[0, 1, 2, 3, "auto"] = Field(
        "auto",
        description="DeepSpeed ZeRO stage. auto: 0 with one training rank in fp32 (nothing to "
        "partition, and ZeRO-1/2's gradient copies slow an all-layer update: bench/README.md section "
        "4), else 2 (bf16 at ZeRO-0 is another DeepSpeed optimizer, not yet shown to give the "
        "quickstart's result); a resumed run keeps the stage its checkpoint was written at "
        "(DeepSpeed cannot load another stage's optimizer state).")
    micro_batch_size: int = Field(4, ge=1, description="Sequences per forward/backward.")
    world_size: int = Field(
        1, ge=1,
        description="Training ranks. 1 with rollout.workers 1 and ray.address null: DeepSpeed in the "
        "flow's process. N > 1: N Ray actors (ray.address), one placement-group bundle each (a GPU "
        "where the cluster has them, else ray.cpus_per_rank CPUs), each a DeepSpeed rank that keeps "
        "weights and optimizer state between iterations and trains on 1/N of a batch.",
    )
    bf16: bool | Literal["auto"] = Field(
        "auto", description="Train in bf16 (DeepSpeed keeps fp32 master weights). auto: where the "
        "hardware has bf16 arithmetic (see model.dtype); on a CPU without it bf16 is "
        "emulated, slower than fp32.")
    gradient_checkpointing: bool = Field(False, description="Trade compute for activation memory.")
    train_layers: int | None = Field(
        None, ge=1,
        description="Train only the top N decoder layers and the final norm (embeddings and lower "
        "layers frozen): the backward pass stops at layer N from the top, so an update costs less "
        "per token (bench/README.md, section 4: SmolLM2's update with the top 8 and with all layers). None: train every weight. Not with lora.")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="Learning rate after warmup: constant, or cosine decay to lr_min_ratio x lr at "
        "lr_decay_steps. Steps are optimizer steps (ppo_epochs x mini_batches per iteration), not "
        "micro-batches: micro-batches of a mini-batch accumulate into one step.",
    )
    lr_warmup_steps: int = Field(
        0, ge=0, description="Optimizer steps of linear warmup (step k uses lr x k / warmup, k = 1..)."
    )
    lr_decay_steps: int = Field(
        0, ge=0,
        description="cosine: optimizer step (warmup included) at which the decay ends, e.g. "
        "iterations x ppo_epochs x mini_batches of the whole run. Unused by constant.",
    )
    lr_min_ratio: float = Field(0.0, ge=0, le=1, description="cosine: final lr as a share of learning_rate.")
    lora: LoraSettings | None = Field(
        None,
        description="Train LoRA adapters (peft) instead of all weights; None trains all weights. "
        "Checkpoints hold the adapters; exports and weight syncs are merged full weights.",
    )
    @model_validator(mode="after")
    def _check_lr(self) -> "TrainerConfig":
        if self.train_layers is not None and self.lora is not None:
            raise ValueError("trainer.train_layers and trainer.lora both limit what trains; keep one "
                             "(train_layers: null, or lora: null)")
        if self.lr_schedule == "cosine" and self.lr_decay_steps <= self.lr_warmup_steps:
            raise ValueError(
                f"lr_schedule=cosine needs lr_decay_steps > lr_warmup_steps (got {self.lr_decay_steps} "
                f"<= {self.lr_warmup_steps}); set lr_decay_steps to the run's optimizer steps "
                "(iterations x ppo_epochs x mini_batches) or use lr_schedule: constant"
            )
        return self


class StageSpec(_Strict):
    horizon: int = Field(..., ge=1, description="Maximum interaction turns in this stage.")
    iterations: int = Field(..., ge=1, description="RL iterations in this stage.")
    tasks: dict[str, list[int]] | None = Field(
        None, description="Training tasks of this stage per environment name, each a subset of that "
        "environment's envs[].tasks (a task curriculum: easy tasks first, e.g. {babyai: [0, 1, 2]}); "
        "ids or 'start:stop[:step]' ranges as in envs[].tasks; an environment not named keeps all its tasks.",
        json_schema_extra=_form_note("Empty (None): every environment's tasks."))

    @field_validator("tasks", mode="before")
    @classmethod
    def _expand_ranges(cls, v: Any) -> Any:
        return {k: expand_task_ranges(ids) for k, ids in v.items()} if isinstance(v, dict) else v


class ScheduleConfig(_Strict):
    """ScalingInter-RL: stages of growing horizon. Either ``stages`` or AgentGym-RL's shorthand
    ``rounds`` + ``steps_per_stage``."""

    stages: list[StageSpec] | None = Field(
        None, description="Explicit stages: [{horizon: 6, iterations: 10}, ...].",
        json_schema_extra=_form_note("Empty (None): the stages come from rounds and steps_per_stage."),
    )
    rounds: list[int] | None = Field(None, description="Shorthand: horizons per stage, e.g. [6, 13, 20].",
                                     json_schema_extra=_form_note("Empty (None) when stages are given."))
    steps_per_stage: int | None = Field(None, ge=1, description="Shorthand: iterations per stage.",
                                        json_schema_extra=_form_note("Empty (None) when stages are given."))
    max_env_steps: int | None = Field(
        None, ge=1,
        description="An environment-step budget: the run ends after the iteration whose training "
        "rollouts bring its environment steps (turns played, every stage, a resumed run's earlier "
        "attempts included) to this many or more; its later iterations and stages are skipped and "
        "the held-out evaluation (heldout.enabled) scores the policy at that point. For comparisons "
        "at equal environment steps (bench/learning/table1.py's fixed-horizon row). Needs "
        "rollout.async_steps: 0.",
        json_schema_extra=_form_note("Empty (None): no budget, every stage's iterations run."))

    @model_validator(mode="after")
    def _resolve(self) -> "ScheduleConfig":
        if self.stages is None and self.rounds is None:
            raise ValueError(
                "schedule needs stages: write either stages: [{horizon: 6, iterations: 3}, ...] "
                "or rounds: [6, 13, 20] with steps_per_stage: N"
            )
        if self.stages is not None and self.rounds is not None:
            raise ValueError("schedule has both stages and rounds; keep only one of them")
        if self.rounds is not None:
            if self.steps_per_stage is None:
                raise ValueError("schedule.rounds needs schedule.steps_per_stage (iterations per stage)")
            if any(r < 1 for r in self.rounds):
                raise ValueError(f"schedule.rounds must be positive horizons, got {self.rounds}")
        if not self.resolved():
            raise ValueError("schedule has no stages; give at least one")
        return self

    def resolved(self) -> list[StageSpec]:
        if self.stages is not None:
            return list(self.stages)
        return [StageSpec(horizon=r, iterations=self.steps_per_stage) for r in self.rounds or []]


class StoreConfig(_Strict):
    root: str = Field(
        "./trajectories", description="Trajectory store root: a local folder or an s3://bucket/prefix."
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec options for s3:// (e.g. {client_kwargs: {endpoint_url: ...}}).",
    )
    chunk_episodes: int = Field(
        64, ge=1,
        description="The rollout writes finished episodes to staged (hidden) shards of this many "
        "episodes as they end, and commits the iteration once at its end (all-or-nothing), so "
        "memory does not grow with the number of episodes. Larger: fewer, bigger files.",
    )


class TrackingConfig(_Strict):
    tracking_uri: str = Field("sqlite:///mlflow.db", description="MLflow tracking URI.")
    experiment: str = Field("agentgym-rl", description="MLflow experiment name.")
    checkpoint_every: int = Field(
        0, ge=0, description="Also checkpoint every N global steps (0: only at the end of a stage)."
    )
    checkpoint_trainer_state: bool = Field(
        False,
        description="Also store the trainer's DeepSpeed state (optimizer moments, LR schedule, RNG) "
        "with each checkpoint, so a resumed run continues exactly; costs ~12 bytes per parameter "
        "(about 1.6 GB for SmolLM2-135M). False: a resume restores weights and restarts AdamW.",
    )
    trainer_states_kept: int = Field(
        1, ge=0,
        description="With checkpoint_trainer_state: keep the trainer state of only the newest N "
        "checkpoints of the run (older ones keep their weights and lose their state once a newer "
        "checkpoint is committed), so the disk holds N states however many checkpoints the run "
        "takes. 0: keep every checkpoint's state.",
    )
    eval_every: int = Field(
        0, ge=0,
        description="Evaluate on every env's eval_tasks every N global steps (0: never); metrics "
        "eval/ENV/CATEGORY/avg_at_K (e.g. eval/babyai/goto/avg_at_4) on the pipeline run at step N.",
    )
    eval_k: int = Field(4, ge=1, description="Samples per held-out task for Avg@k / Pass@k during training.")
    ui_url: str | None = Field(
        None, description="Base URL of the MLflow UI, for the links in Prefect artifacts (e.g. "
        "http://127.0.0.1:5000). None: the tracking URI when it is an http(s) server, else "
        "http://127.0.0.1:5000 (where `mlflow ui` serves by default).")
    artifact_location: str | None = Field(
        None, description="Where a new experiment keeps its MLflow artifacts (checkpoints, the logged "
        "model): a folder or s3://bucket/prefix; the experiment gets its own sub-folder. None: beside a "
        "SQLite tracking DB (mlartifacts/), else the tracking server's default. An existing "
        "experiment keeps its location (a different one is refused: use a new experiment name). On S3 "
        "the credentials come from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY or "
        "AWS_PROFILE), never from this config, which is logged.")
    s3_endpoint_url: str | None = Field(
        None, description="S3 endpoint of artifact_location for an S3-compatible server (MinIO, "
        "SeaweedFS, e.g. http://127.0.0.1:8333). None: MLFLOW_S3_ENDPOINT_URL from the environment, "
        "else AWS S3.")
    log_model: bool = Field(
        True, description="Log the final policy (the last stage's checkpoint) as an MLflow model "
        "of the pipeline run: a pyfunc that loads the Hugging Face folder and generates replies.")
    registered_model_name: str | None = Field(
        None, description="Also register the logged final policy as a new version of this MLflow "
        "registered model (created if missing). None: log only, register nothing.")

    @model_validator(mode="after")
    def _registering_needs_the_model(self) -> "TrackingConfig":
        if self.registered_model_name and not self.log_model:
            raise ValueError("tracking.registered_model_name needs tracking.log_model: true (the "
                             "registered version is the logged model); set it, or drop the name")
        return self


class SFTConfig(_Strict):
    """Supervised warm start on scripted-expert demonstrations, before the RL stages (AgentGym's
    behavioural cloning step): the policy learns the action format and a sensible first policy,
    so the RL reward is not silent."""

    enabled: bool = Field(
        False, description="Run the SFT stage (a Prefect subflow with its own MLflow run) before "
        "the ScalingInter-RL stages; the RL stages then start from its checkpoint.")
    episodes: int = Field(
        200, ge=1, description="Successful expert demonstrations to train on, drawn round-robin over "
        "the environments' training tasks with fresh reset seeds (failed attempts are dropped).")
    heldout_episodes: int = Field(
        16, ge=0, description="Expert demonstrations on the eval_tasks, never trained on: the "
        "held-out cross-entropy (sft/heldout_loss) before and after the stage. 0: none.")
    horizon: int = Field(20, ge=1, description="Turn limit of an expert episode.")
    attempts_per_episode: int = Field(
        4, ge=1, description="Expert attempts allowed per demonstration wanted (episodes and "
        "heldout_episodes each): generation stops with an error after attempts_per_episode x wanted "
        "attempts. Raise it for tasks the scripted expert often fails.")
    noise: float = Field(
        0.0, ge=0, lt=1,
        description="Probability that a turn of a demonstration is a random valid action instead of "
        "the expert's (kept as context, not trained on): the policy then sees off-track states and "
        "the expert's recovery from them.")
    epochs: int = Field(2, ge=1, description="Passes over the demonstrations.")
    batch_size: int = Field(
        8, ge=1, description="Demonstrations per optimizer step (accumulated in "
        "trainer.micro_batch_size micro-batches).")
    learning_rate: float = Field(
        5e-5, gt=0, description="AdamW learning rate of the SFT stage (the RL stages keep "
        "trainer.learning_rate); the other trainer settings (ZeRO, bf16, LoRA) are shared.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps, then cosine decay to 10%.")
    seed: int = Field(0, description="Seed of the demonstrations (tasks, reset seeds, noise) and "
                                     "of the SFT batches.")


class HeldOutConfig(_Strict):
    """Before/after evaluation on the held-out ``eval_tasks``: the random-valid-action policy and
    the base model before training, the policy after SFT and after each RL stage, side by side."""

    enabled: bool = Field(
        False, description="Run the before/after evaluations (MLflow series heldout/greedy_at_1 at each "
        "policy's global step, details heldout-by-policy/POLICY.ENV.CATEGORY..., "
        "one Prefect table artifact, the CLI summary's table).")
    horizon: int | None = Field(
        None, ge=1, description="Turn limit of the held-out episodes (None: the last stage's horizon).")
    k: int = Field(
        1, ge=1, description="1: greedy@1 only. k > 1: also k sampled episodes per task (Avg@k, Pass@k).")
    random_seeds: int = Field(
        10, ge=1, description="Seeds of the random-valid-action baseline, averaged (its single-seed "
        "spread on 40 BabyAI tasks is 15-50%).")
    seed: int = Field(0, ge=0, description="Environment reset seed of the held-out episodes.")
    every_stage: bool = Field(
        True, description="Evaluate the policy at the end of every ScalingInter-RL stage; False: after "
        "the last stage only (each evaluation plays every held-out task to the horizon).")
    base: bool = Field(
        True, description="Evaluate the starting model (model.name_or_path) as the 'base' row. False "
        "when it was measured elsewhere: runs that start from a shared warm-start checkpoint (the "
        "ablation) would otherwise each replay the same deterministic evaluation.")


class RayConfig(_Strict):
    """Where trainer ranks and rollout workers run when they are more than the flow's process."""

    address: str | None = Field(
        None,
        description="null: no Ray while trainer.world_size and rollout.workers are both 1 (everything "
        "in the flow's process), else an embedded single-node cluster on 127.0.0.1. local: always an "
        "embedded cluster. host:port (a `ray start --head` node's GCS address) or ray://host:10001 "
        "(Ray Client): attach to that cluster; its nodes place the actors.",
    )
    cpus_per_rank: float = Field(
        1.0, gt=0,
        description="CPUs one training rank's bundle asks for where it gets no GPU (a CPU-only "
        "cluster); with GPUs a rank asks for one GPU and this many CPUs.",
    )
    cpus_per_worker: float = Field(
        1.0, gt=0, description="CPUs one rollout worker asks for (its engine's threads on CPU).")
    gpus_per_worker: float = Field(
        0.0, ge=0,
        description="GPUs one rollout worker asks for (vllm: 1; a fraction shares a GPU with a rank). "
        "0: none (CPU engine).")
    worker_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each rollout worker asks for beside its CPUs/GPUs, to keep "
        "workers on the nodes meant for them: e.g. {rollout_node: 1} with nodes started as `ray start "
        "--address=HEAD:6379 --resources='{\"rollout_node\": 4}'`. {}: any node.")
    weight_sync: Literal["object_store", "broadcast", "cuda_ipc"] = Field(
        "object_store",
        description="How full weights go from training rank 0 to the rollout workers after each "
        "update. object_store: rank 0 puts them in Ray's object store once, each worker fetches them "
        "from its node's store (any cluster). broadcast: rank 0 and the workers form a process group "
        "of their own (NCCL on GPUs, gloo on CPUs) and rank 0 broadcasts the weights in byte buckets "
        "(as OpenRLHF); NCCL refuses two members on one GPU. cuda_ipc: trainer and workers share one "
        "GPU (ray.gpus_per_worker a fraction); workers map rank 0's tensors by CUDA IPC handles.")
    rank_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each training rank's bundle asks for beside its CPUs/GPUs "
        "(as worker_resources, for the ranks), e.g. {trainer_node: 1}. {}: any node.")
    num_cpus: int | None = Field(
        None, ge=1,
        description="Embedded cluster only: CPUs it offers (None: the machine's). Each actor asks "
        "for its bundle; too few CPUs for world_size x cpus_per_rank + workers x cpus_per_worker "
        "and placement waits, so the run stops with an error after ray.placement_timeout_s.")
    placement_timeout_s: float = Field(
        300.0, gt=0,
        description="Seconds to wait for the cluster to place the ranks' and workers' actors (e.g. "
        "for a node to join) before the run stops with an error naming what is missing.")
    placement: Literal["PACK", "SPREAD"] = Field(
        "PACK",
        description="How the training ranks' bundles are placed: PACK fills a node before the next "
        "(NCCL within a node is fastest); SPREAD puts ranks on different nodes where it can.")
    max_actor_restarts: int = Field(
        3, ge=0,
        description="Times dead rollout workers are re-created within one call (a rollout, a weight "
        "sync) before the call fails; a re-created worker gets the current weights and plays its "
        "share again. A dead training rank is not re-created in place: the update fails and a re-run "
        "resumes from the latest checkpoint.")

    @model_validator(mode="after")
    def _ipc_needs_a_gpu(self) -> "RayConfig":
        if self.weight_sync == "cuda_ipc" and self.gpus_per_worker <= 0:
            raise ValueError("ray.weight_sync=cuda_ipc maps the trainer's GPU memory into the workers: give "
                             "each worker a share of that GPU (ray.gpus_per_worker, e.g. 0.5), or use "
                             "weight_sync: object_store / broadcast")
        return self

    @field_validator("address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is None or v in ("local", "auto") or v.startswith("ray://"):
            return v
        host, _, port = v.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"ray.address={v!r}: use null, local, auto, host:port (the head node's "
                             "GCS port, 6379 by default) or ray://host:10001")
        return v


class PipelineConfig(_Strict):
    run_id: str | None = Field(
        None, description="Pipeline run id; reuse one to resume. None: a new id is generated."
    )
    seed: int = Field(0, description="Seed for task sampling, generation and training.")
    system_prompt: str | None = Field(
        None, description="Override the environment's system prompt (None keeps the adapter's)."
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    envs: list[EnvSpec] = Field(default_factory=lambda: [EnvSpec()], description="Environments.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout generation.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantages and losses.")
    reward: RewardConfig = Field(
        default_factory=RewardConfig,
        description="Rewards beyond the environment's: reward.judge, an LLM judge scoring each group's episodes "
        "relative to each other (agentgym.rewards.judge).")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="DeepSpeed policy updates.")
    schedule: ScheduleConfig = Field(
        default_factory=lambda: ScheduleConfig(rounds=[6, 13, 20], steps_per_stage=3),
        description="ScalingInter-RL stages (horizon and iterations of each).",
    )
    sft: SFTConfig = Field(default_factory=SFTConfig, description="Supervised warm start on expert demonstrations.")
    heldout: HeldOutConfig = Field(default_factory=HeldOutConfig,
                                   description="Before/after evaluation on the held-out tasks.")
    store: StoreConfig = Field(default_factory=StoreConfig, description="Trajectory store.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking and checkpoints.")
    ray: RayConfig = Field(default_factory=RayConfig,
                           description="The Ray cluster for training ranks and rollout workers beyond the flow's process.")

    @model_validator(mode="after")
    def _cross(self) -> "PipelineConfig":
        est = self.algorithm.estimator
        if est in (Estimator.GRPO, Estimator.RLOO) and self.rollout.group_size < 2:
            raise ValueError(
                f"algorithm.estimator={est.value} needs rollout.group_size >= 2 (a baseline needs "
                "several samples of the same task); raise group_size or use reinforce_pp"
            )
        batch = self.rollout.tasks_per_iteration * self.rollout.group_size
        if batch < self.algorithm.mini_batches:
            raise ValueError(
                f"algorithm.mini_batches={self.algorithm.mini_batches} exceeds the rollout batch "
                f"({batch} episodes); lower mini_batches or raise tasks_per_iteration/group_size"
            )
        if self.sft.enabled:
            from env_adapters.experts import EXPERTS

            missing = sorted({e.name for e in self.envs} - set(EXPERTS))
            if missing:
                raise ValueError(
                    f"sft.enabled needs a scripted expert for every environment; none for {missing} "
                    f"(experts: {sorted(EXPERTS)}); drop those envs or set sft.enabled: false")
        if self.rollout.async_steps and self.algorithm.recompute_old_logprobs:
            raise ValueError(
                "rollout.async_steps > 0 trains on episodes sampled by an older policy: the PPO ratio "
                "must be taken against the sampler's log-probs, so set algorithm.recompute_old_logprobs: "
                "false (or rollout.async_steps: 0)")
        if self.schedule.max_env_steps is not None and self.rollout.async_steps:
            raise ValueError(
                "schedule.max_env_steps ends the run after the iteration that reaches it, but "
                f"rollout.async_steps={self.rollout.async_steps} plays later iterations' rollouts before "
                "that is known; set rollout.async_steps: 0 or schedule.max_env_steps: null")
        self._check_stage_tasks()
        if self.heldout.enabled and not any(e.eval_tasks for e in self.envs):
            raise ValueError("heldout.enabled needs eval_tasks on at least one environment; list "
                             "held-out task ids in envs[].eval_tasks or set heldout.enabled: false")
        if self.reward.judge is not None and self.algorithm.credit == "turn":
            raise ValueError("reward.judge scores whole episodes, but algorithm.credit=turn trains on each turn's own "
                             "reward; set algorithm.credit: outcome, or remove reward.judge")
        if self.rollout.engine == "vllm_server":
            self._check_vllm_server()
        if self.rollout.engine == "vllm":
            import importlib.util

            if importlib.util.find_spec("vllm") is None:
                raise ValueError(
                    "rollout.engine=vllm needs the vllm package, which lives in its own environment: "
                    "run `bash scripts/setup_vllm_env.sh` (`agentgym train` then runs such a config "
                    "there by itself; $AGENTGYM_VLLM_PYTHON names another interpreter with vllm), "
                    "or set rollout.engine: hf"
                )
        return self

    def _check_stage_tasks(self) -> None:
        envs = {e.name: e for e in self.envs}
        for i, stage in enumerate(self.stages):
            for name, tasks in (stage.tasks or {}).items():
                where = f"schedule.stages[{i}].tasks.{name}"
                if name not in envs:
                    raise ValueError(f"{where}: no environment named {name!r} in envs "
                                     f"({sorted(envs)}); name one of them or drop the entry")
                if not tasks:
                    raise ValueError(f"{where} is empty; list at least one task or drop the entry "
                                     "(the environment then keeps all its tasks)")
                extra = sorted(set(tasks) - set(envs[name].tasks))
                if extra:
                    raise ValueError(f"{where} has tasks {extra[:8]} that are not in that environment's "
                                     "envs[].tasks (a stage trains on a subset of them); add them there or "
                                     "drop them here")

    def _check_vllm_server(self) -> None:
        if self.uses_ray:
            raise ValueError(
                "rollout.engine=vllm_server with Ray (ray.address, rollout.workers or trainer.world_size > 1): "
                "rollout workers receive full weights from training rank 0, which `vllm serve` endpoints "
                "cannot take; give each worker its own engine (rollout.engine: vllm on GPU workers, or hf), "
                "or keep vllm_server with ray.address: null and one rank")
        lora = self.trainer.lora
        if lora is None:
            raise ValueError(
                "rollout.engine=vllm_server syncs weights as LoRA adapters (POST /v1/load_lora_adapter): "
                "set trainer.lora (e.g. {r: 8}); for full fine-tuning with rollouts on other hosts use Ray "
                "rollout workers (rollout.workers, rollout.engine: vllm or hf), which receive full weights "
                "(docs/scale-out.md)")
        if lora.modules_to_save:
            raise ValueError(
                f"trainer.lora.modules_to_save={lora.modules_to_save}: vLLM LoRA adapters carry only "
                "the low-rank matrices, so fully trained modules would not reach the servers; set "
                "modules_to_save: [] with rollout.engine=vllm_server")
        if self.sft.enabled or self.heldout.enabled:
            which = "sft.enabled" if self.sft.enabled else "heldout.enabled"
            raise ValueError(
                f"{which} with rollout.engine=vllm_server: the servers serve the base model plus the "
                "run's live adapter, not saved checkpoints (the SFT warm start and held-out evaluation "
                f"load checkpoints); set {which}: false, or use rollout.engine: hf or vllm")

    @property
    def stages(self) -> list[StageSpec]:
        return self.schedule.resolved()

    @property
    def uses_ray(self) -> bool:
        """Whether ranks and rollout workers run as Ray actors (``ray.address``)."""
        return (self.ray.address is not None or self.trainer.world_size > 1
                or self.rollout.workers > 1)

    @property
    def seeds_per_episode(self) -> bool:
        """Whether sampling is seeded per (episode, turn) (``rollout.sampling_seeds``)."""
        mode = self.rollout.sampling_seeds
        return mode == "per_episode" or (mode == "auto" and self.rollout.workers > 1)


#: fields that are gone, and what replaced them (the error for an old config names the new fields)
_RAY_NOW = ("training ranks now run as Ray actors: remove it; trainer.world_size sets the ranks and "
            "ray.address the cluster (null/local: embedded on this host; host:port: a cluster other "
            "nodes joined with `ray start --address=...`), see docs/scale-out.md")
REMOVED_FIELDS = {f"trainer.{k}": _RAY_NOW for k in ("hostfile", "nnodes", "master_addr", "master_port",
                                                     "driver_port")}


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the field and the fix."""


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = REMOVED_FIELDS.get(loc, "unknown field; remove it or check its spelling against "
                                          "docs/configuration.md")
        lines.append(f"  - {loc}: {msg}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any], source: str = "<dict>") -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


def _parse_override(item: str) -> tuple[str, Any]:
    """``"a.b=value"`` -> ``("a.b", value parsed as YAML)``."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like field.path=value")
    key, raw = item.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({' '.join(str(e).split())}); "
                          "quote it for the shell, e.g. --set 'envs.0.tasks=[1, 2]'") from None


def apply_overrides(data: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """The one override path (``agentgym train|eval|config check --set``, the flows'
    ``overrides`` parameter, deployments): apply ``a.b.c=value`` overrides (value parsed as YAML;
    a number indexes a list, as in ``envs.0.tasks=[1,2]``) to a raw config dict, in place.

    Setting ``schedule.stages`` drops the config's ``schedule.rounds`` shorthand (and the other
    way round), so one override replaces a schedule whichever form the file used.
    """
    keys = []
    for item in overrides or []:
        key, value = _parse_override(item)
        keys.append(key)
        set_path(data, key, value, item)
    sched = data.get("schedule")
    if isinstance(sched, dict):
        sets_stages = any(k.startswith("schedule.stages") for k in keys)
        sets_rounds = any(k.startswith(("schedule.rounds", "schedule.steps_per_stage")) for k in keys)
        if sets_stages and not sets_rounds:
            sched.pop("rounds", None)
            sched.pop("steps_per_stage", None)
        if sets_rounds and not sets_stages:
            sched.pop("stages", None)
    return data


def set_path(data: dict[str, Any], key: str, value: Any, item: str | None = None) -> None:
    """Set ``data[a][b]...`` for ``key = "a.b..."``; numbers index lists, missing sections are made."""
    item = item or f"{key}=..."
    parts = key.strip().split(".")
    node: Any = data
    for i, p in enumerate(parts):
        last = i == len(parts) - 1
        where = ".".join(parts[:i]) or "<root>"
        if isinstance(node, list):
            try:
                idx = int(p)
            except ValueError:
                raise ConfigError(f"override {item!r}: {where} is a list; index it with a number, "
                                  f"e.g. {where}.0.{'.'.join(parts[i + 1:]) or '...'}") from None
            if not -len(node) <= idx < len(node):
                raise ConfigError(f"override {item!r}: {where} has {len(node)} item(s), no index {idx}")
            if last:
                node[idx] = value
                return
            node = node[idx]
        elif isinstance(node, dict):
            if last:
                node[p] = value
                return
            if node.get(p) is None:
                node[p] = {}
            node = node[p]
        else:
            raise ConfigError(f"override {item!r}: {where} is not a section")


def with_overrides(config: PipelineConfig, overrides: list[str] | None) -> PipelineConfig:
    """``config`` with ``apply_overrides`` applied to its fields (validated like a config file)."""
    if not overrides:
        return config
    data = apply_overrides(config.model_dump(mode="json", exclude_none=True), overrides)
    return parse_config(data, source=f"overrides {list(overrides)}")


def load_config(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    return parse_config(config_data(path, overrides), source=str(path))


def config_data(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """The YAML mapping of config file ``path`` with ``overrides`` applied, not yet validated
    (``ConfigError`` for a missing or malformed file)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist" + (" (it is a directory)" if path.is_dir() else ""))
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:  # the message carries the line and column
        raise ConfigError(f"config file {path} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return apply_overrides(data, overrides)
