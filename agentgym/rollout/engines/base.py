"""The inference-engine protocol shared by the HF (CPU default) and vLLM engines."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from agentgym.config import DEFAULT_MAX_NEW_TOKENS


@dataclass
class SamplingParams:
    """How an engine samples the replies of one ``generate`` / ``choose`` call.

    Seeding has two modes:

    * ``row_seeds`` None (the default, ``rollout.sampling_seeds: per_call``): ``seed`` seeds the
      whole call; the rows' draws come from one random stream in batch order (HF: one
      ``torch.Generator``; vLLM: a request seed derived from ``seed`` and the row index), so a
      prompt's reply depends on the batch it is in and its row there;
    * ``row_seeds`` given (``per_episode``): one seed per prompt, ``row_seeds[i]`` for
      ``prompts[i]``; each row samples from its own stream and ``seed`` is not used, so a
      prompt's reply does not depend on which other prompts share the call (the rollout passes
      each episode's ``episode_turn_seed``: N rollout workers play the same episodes as one).
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    #: ``choose`` only: draw candidate ``a`` with probability proportional to
    #: ``pi(a)^(1/choice_temperature)`` (``rollout.action_temperature``)
    choice_temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    seed: int = 0
    row_seeds: list[int] | None = None


@dataclass
class Sample:
    """One generated reply: the ids the engine sampled and their log-probs.

    ``logprobs[i]`` is ``log softmax(logits / temperature)[token_ids[i]]`` (the sampling
    distribution before top-p truncation), the quantity the trainer recomputes.
    ``choice_logprobs`` (``choose`` only): the same per-token log-probs of every candidate, in the
    order given, from which the rollout renormalises (``rollout.action_logprob``).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    choice_logprobs: list[list[float]] | None = None


def check_prompts(prompts: list[list[int]], cache_keys: list[str] | None,
                  params: SamplingParams | None = None) -> None:
    """The argument checks every engine's ``generate`` makes."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    if cache_keys is not None and len(cache_keys) != len(prompts):
        raise ValueError("generate: cache_keys needs one key per prompt")
    if params is not None and params.row_seeds is not None and len(params.row_seeds) != len(prompts):
        raise ValueError(f"generate: row_seeds needs one seed per prompt ({len(params.row_seeds)} seeds, "
                         f"{len(prompts)} prompts)")


class InferenceEngine(Protocol):
    """What the rollout and the pipeline use of an engine; every engine implements all of it.

    An engine that cannot do an operation for its backend (``choose`` on vLLM, ``update_weights``
    on ``vllm_server``) raises ``NotImplementedError`` naming the setting to change; the config
    checks (``RolloutConfig``) refuse those combinations before an engine is built.
    """

    #: wall seconds spent inside ``generate`` / ``choose`` since the engine was built (the
    #: pipeline's ``time/generate_s`` is the difference across one rollout)
    generate_seconds: float
    #: tokens sampled by ``generate`` / ``choose`` since the engine was built (the pipeline's
    #: throughput metrics take the difference across one rollout)
    generated_tokens: int
    #: True: the policy reaches this engine as a LoRA adapter (``update_adapter``), not as
    #: merged weights (``update_weights``)
    syncs_adapters: bool

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 cache_keys: list[str] | None = None) -> list[Sample]:
        """Generate one reply per prompt (prompts are token ids, no padding).

        ``cache_keys`` names each prompt's conversation; an engine may keep its KV cache so
        that the conversation's next, longer prompt only prefills the new tokens.
        """

    def choose(self, prompts: list[list[int]], choices: list[list[list[int]]], params: SamplingParams,
               cache_keys: list[str] | None = None) -> list[Sample]:
        """For each prompt, one of its candidate replies ``choices[i]`` drawn by the policy's
        likelihood (``rollout.constrain_actions``); ``params.greedy``: the most likely one."""

    def release(self, keys: Iterable[str]) -> None:
        """Drop any state kept for the conversations ``keys``."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights before the next rollout (engines with ``syncs_adapters`` false)."""

    def update_adapter(self, save: Callable[[Path], Any]) -> str:
        """``save(folder)`` writes the policy's LoRA adapter; the engine serves it from the next
        request on and returns its name (engines with ``syncs_adapters`` true)."""

    def close(self) -> None:
        """Release the engine."""
