"""The inference-engine protocol shared by the HF (CPU default) and vLLM engines."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    seed: int = 0


@dataclass
class Sample:
    """One generated reply: the ids the engine sampled and their log-probs.

    ``logprobs[i]`` is ``log softmax(logits / temperature)[token_ids[i]]`` (the sampling
    distribution before top-p truncation), the quantity the trainer recomputes.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]


def check_prompts(prompts: list[list[int]], cache_keys: list[str] | None) -> None:
    """The argument checks every engine's ``generate`` makes."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    if cache_keys is not None and len(cache_keys) != len(prompts):
        raise ValueError("generate: cache_keys needs one key per prompt")


class InferenceEngine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 cache_keys: list[str] | None = None) -> list[Sample]:
        """Generate one reply per prompt (prompts are token ids, no padding).

        ``cache_keys`` names each prompt's conversation; an engine may keep its KV cache so
        that the conversation's next, longer prompt only prefills the new tokens.
        """

    def release(self, keys: Iterable[str]) -> None:
        """Drop any state kept for the conversations ``keys``."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights before the next rollout."""

    def close(self) -> None:
        """Release the engine."""
