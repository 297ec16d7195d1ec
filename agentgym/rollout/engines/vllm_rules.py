"""Request rules shared by the two vLLM engines (in-process ``vllm`` and HTTP ``vllm_server``).

Both ask vLLM for the same thing, so the rules live once, here, without importing vllm (the
``vllm_server`` engine runs in the main env):

* :func:`request_fields`: the sampling fields of one row's request, valid both as
  ``vllm.SamplingParams(**fields)`` and as the body of ``POST /v1/completions``: a per-row seed
  (:func:`request_seed`: G copies of one prompt still differ; from ``SamplingParams.row_seeds``
  where given), greedy as ``temperature=0`` at T == 1 and as ``top_k=1`` at temperature T
  otherwise (argmax, with ``log_softmax(logits / T)`` log-probs), the caller's stop ids and
  strings (stop string kept in the reply), vLLM's EOS handling off;
* :func:`generate_with_stop_rule`: the HF engine's stop-string rule on top of vLLM's: a stop
  string inside the reply's leading whitespace does not end it, so such a reply is continued
  (another request on prompt + reply so far, with another seed salt).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentgym.rollout.engines.base import Sample, SamplingParams

_SEED_MASK = (1 << 31) - 1


def row_seed(seed: int, row: int, salt: int = 0) -> int:
    """The request seed of row ``row`` (``salt``: the continuation round)."""
    return (int(seed) * 1_000_003 + row * 7_919 + salt * 104_729) & _SEED_MASK


def request_seed(params: SamplingParams, row: int, salt: int = 0) -> int:
    """The vLLM seed of the request for row ``row`` of a call (``salt``: the continuation round).

    Per call (``params.row_seeds`` None): derived from the call's ``seed`` and the row index, so
    a reply depends on its row in the batch. Per row: derived from ``row_seeds[row]`` alone (as
    row 0 of its own call), so a reply is the same whichever batch and row it is in."""
    if params.row_seeds is None:
        return row_seed(params.seed, row, salt)
    return row_seed(params.row_seeds[row], 0, salt)


def request_fields(params: SamplingParams, row: int, max_tokens: int, salt: int = 0) -> dict[str, Any]:
    """The sampling fields of the request for row ``row`` (its index in the call's prompts, also
    in a continuation round ``salt``) asking for at most ``max_tokens`` tokens."""
    fields: dict[str, Any] = dict(
        n=1,
        max_tokens=max_tokens,
        seed=request_seed(params, row, salt),
        stop_token_ids=list(params.stop_token_ids),
        stop=list(params.stop_strings),
        include_stop_str_in_output=True,
        ignore_eos=True,  # only the caller's stop ids end a reply (as in the HF engine)
        logprobs=0,  # the sampled token's log-prob only
        skip_special_tokens=True,
    )
    if params.greedy:
        if abs(params.temperature - 1.0) < 1e-12:
            fields.update(temperature=0.0)
        else:  # argmax, but with log_softmax(logits / T) as its log-probs
            fields.update(temperature=float(params.temperature), top_k=1, top_p=1.0)
    else:
        fields.update(temperature=float(params.temperature), top_p=float(params.top_p))
    return fields


@dataclass
class Piece:
    """What one vLLM request returned for one row."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None  # "stop", "length", ...
    stop_reason: int | str | None  # the stop string (str) or stop id (int) that ended it


def stop_counts(tokenizer, ids: list[int], stops: list[str]) -> bool:
    """The HF engine's rule: a stop string counts once the reply has non-blank text."""
    body = tokenizer.decode(ids, skip_special_tokens=True).lstrip()
    return any(s in body for s in stops)


def generate_with_stop_rule(prompts: list[list[int]], params: SamplingParams, tokenizer,
                            run: Callable[[list[list[int]], list[dict[str, Any]]], list[Piece]]) -> list[Sample]:
    """One reply per prompt: ``run(prompts, fields)`` asks vLLM for one piece per prompt, and
    replies that vLLM ended on a stop string inside their leading whitespace are continued."""
    n = len(prompts)
    ids: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    reasons: list[str] = ["length"] * n
    todo = list(range(n)) if params.max_new_tokens > 0 else []
    salt = 0
    while todo:
        fields = [request_fields(params, i, params.max_new_tokens - len(ids[i]), salt) for i in todo]
        pieces = run([prompts[i] + ids[i] for i in todo], fields)
        again: list[int] = []
        for i, piece in zip(todo, pieces):
            ids[i].extend(int(t) for t in piece.token_ids)
            lps[i].extend(float(x) for x in piece.logprobs)
            if piece.finish_reason != "stop":
                reasons[i] = "length"
                continue
            reasons[i] = "stop"
            # vLLM stopped on a stop string that lies in the reply's leading whitespace:
            # the HF engine would go on, so continue this reply (prefix cache: cheap).
            if (isinstance(piece.stop_reason, str) and len(ids[i]) < params.max_new_tokens
                    and not stop_counts(tokenizer, ids[i], params.stop_strings)):
                reasons[i] = "length"
                again.append(i)
        todo, salt = again, salt + 1
    return [Sample(ids[i], lps[i], reasons[i]) for i in range(n)]  # type: ignore[arg-type]
