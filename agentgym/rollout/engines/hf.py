"""Batched sampling with transformers on CPU (or one GPU): the default rollout engine.

A hand-written decode loop instead of ``model.generate`` so that

* the log-probs are exactly those of the sampling distribution (``log_softmax(logits / T)``);
* sampling is seeded through explicit ``torch.Generator``s (same seed + prompts -> same tokens):
  one per call (``SamplingParams.seed``), or one per row (``row_seeds``: a row's tokens then do
  not depend on the other rows of the batch; ``_Draws``);
* rows that finish early leave the batch (their KV-cache rows are dropped);
* **the KV cache of a conversation is kept across turns** (``cache_keys``): the next turn's
  prompt extends the previous one, so only the new tokens (last reply token, template glue,
  observation) are prefilled instead of the whole conversation. Prefill is what dominates a
  multi-turn rollout on CPU; keeping the cache makes a turn cost O(new tokens), not O(context).
* **action-constrained decoding** (``choose``): instead of sampling free text, score each of
  a turn's candidate replies (the valid actions) by the policy's likelihood and sample one.

* **prefill runs in groups of rows of similar new-token length** (``length_groups``): on a
  CPU a padded token costs as much as a real one, and one batch padded to its longest
  observation computed 2x the real tokens of a BabyAI evaluation.

Batch layout of one prefill group (per row, left to right):
``[pad][cached prefix K/V][pad][new prompt tokens]`` with a 2-D attention mask that is 0 on
the pads and explicit position ids, so rows with different cached and new lengths share one
forward pass. The groups' keys/values are then laid out as ``[pad][prefix][new]`` in one cache
for the decode steps.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

from agentgym.rollout.engines.base import Sample, SamplingParams, check_prompts


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    if top_p >= 1.0:
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the most likely token
    sorted_p = sorted_p * keep
    out = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return out / out.sum(-1, keepdim=True)


class _Draws:
    """The random draws of one ``generate`` / ``choose`` call (``SamplingParams``' seeding).

    Per call (``row_seeds`` None): one generator seeded with ``params.seed`` draws every row in
    batch order, one ``torch.multinomial`` over the rows given (the stream this engine has always
    drawn). Per row: row ``r`` of the call draws from its own generator seeded with
    ``row_seeds[r]``, kept across decode steps, so its tokens do not depend on the batch's other
    rows nor on when they leave it.
    """

    def __init__(self, params: SamplingParams):
        def make(seed: int) -> torch.Generator:
            return torch.Generator(device="cpu").manual_seed(int(seed))

        self._call = make(params.seed) if params.row_seeds is None else None
        self._rows = None if params.row_seeds is None else [make(s) for s in params.row_seeds]

    def pick(self, probs: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """One index per row of ``probs`` (2-D, on the CPU) drawn in proportion to it; ``rows[i]``
        is the call's row (its index in the prompts) that ``probs[i]`` belongs to."""
        if self._rows is None:
            assert self._call is not None
            return torch.multinomial(probs, 1, generator=self._call).squeeze(-1)
        return torch.cat([torch.multinomial(probs[i:i + 1], 1, generator=self._rows[r]).squeeze(-1)
                          for i, r in enumerate(rows)])


def length_groups(lengths: list[int], max_padding: float) -> list[list[int]]:
    """Row indices grouped so that each group, padded to its longest row, computes at most
    ``max_padding`` (a fraction) more tokens than it holds. Rows sorted longest first; a group is
    closed when the next row would push it over. On a CPU a forward over a few hundred tokens
    is as efficient per token as a large batch, so many small groups cost nothing extra; padded
    tokens cost as much as real ones. ``max_padding >= 1`` keeps everything in one group."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if max_padding >= 1.0 or len(order) <= 1:
        return [order]
    groups: list[list[int]] = []
    for i in order:
        if groups:
            g = groups[-1]
            longest = lengths[g[0]]
            real = sum(lengths[j] for j in g) + lengths[i]
            if longest * (len(g) + 1) - real <= max_padding * longest * (len(g) + 1):
                g.append(i)
                continue
        groups.append([i])
    return groups


def _layer_kv(layer: object) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache layer's keys and values, (B, heads, T, head_dim) each."""
    if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
        raise TypeError(f"the KV cache holds a {type(layer).__name__} without keys and values (an empty or "
                        "a non-attention layer); this engine reuses attention layers' keys and values only")
    return layer.keys, layer.values


def _row_kv(cache: DynamicCache, row: int, attn_row: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row ``row``'s keys/values at the positions ``attn_row`` marks (its pads dropped), per layer."""
    valid = attn_row.bool()
    return [(k[row][:, valid], v[row][:, valid]) for k, v in map(_layer_kv, cache.layers)]


class ReservedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values live at the front of a buffer with spare room: a
    decode step writes its token's keys/values into the room instead of ``torch.cat``-ing them
    onto the whole cache. ``DynamicLayer`` copies every layer's entire cache at every generated
    token, O(context) per token, a share of each decode step that grows with the context
    (``bench/kv_cache_decode.py`` measures it). ``keys`` / ``values`` are views of the filled part
    (what attention reads);
    the buffer grows by ``reserve`` more tokens (one copy) when full, and a batch selection
    (rows leaving the batch) copies the buffer once."""

    def __init__(self, reserve: int, keys: torch.Tensor | None = None, values: torch.Tensor | None = None,
                 length: int = 0):
        super().__init__()
        self.reserve = max(1, int(reserve))
        self._k, self._v, self._len = keys, values, length
        if keys is not None:
            self.device, self.is_initialized = keys.device, True
            self._views()

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._k is None or self._v is None:
            raise RuntimeError("ReservedLayer: no key/value buffers before the first update")
        return self._k, self._v

    def _views(self) -> None:
        k, v = self._buffers()
        self.keys, self.values = k[:, :, : self._len], v[:, :, : self._len]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.is_initialized = key_states.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        if self._k is None or self._len + new > self._k.shape[-2]:
            cap = self._len + new + self.reserve
            k = key_states.new_empty((*key_states.shape[:2], cap, key_states.shape[-1]))
            v = value_states.new_empty((*value_states.shape[:2], cap, value_states.shape[-1]))
            if self._len:
                k[:, :, : self._len], v[:, :, : self._len] = _layer_kv(self)
            self._k, self._v = k, v
        k, v = self._buffers()
        k[:, :, self._len : self._len + new] = key_states
        v[:, :, self._len : self._len + new] = value_states
        self._len += new
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._len:
            k, v = self._buffers()
            self._k, self._v = k[indices, ...], v[indices, ...]
            self._views()


def reserved_cache(data: list[tuple[torch.Tensor, torch.Tensor, int]] | None, reserve: int) -> DynamicCache:
    """A ``DynamicCache`` of ``ReservedLayer``s: one per ``(keys buffer, values buffer, filled
    length)`` of ``data``, or empty layers made on first use."""
    cache = DynamicCache()
    # transformers types it as a layer class but only calls it: a factory serves
    cache.layer_class_to_replicate = lambda: ReservedLayer(reserve)  # type: ignore[assignment]
    cache.layers = [ReservedLayer(reserve, k, v, n) for k, v, n in data or []]
    return cache


def _right_aligned(rows: list[list[tuple[torch.Tensor, torch.Tensor]] | None], width: int,
                   device: torch.device, reserve: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Per layer, the keys and values buffers of a batch cache, (rows, kv_heads, width +
    ``reserve``, head_dim), and their filled width: each row's keys/values end at ``width``,
    zeros (masked pads) before them, ``reserve`` free positions after (``ReservedLayer``); a
    ``None`` row is all pads. ``rows[i]`` is a per-layer list of (kv_heads, length_i, head_dim)
    pairs."""
    ref = next(r for r in rows if r is not None)
    out = []
    for layer, (rk, rv) in enumerate(ref):
        k = rk.new_zeros((len(rows), rk.shape[0], width + reserve, rk.shape[-1]), device=device)
        v = rv.new_zeros((len(rows), rv.shape[0], width + reserve, rv.shape[-1]), device=device)
        for i, r in enumerate(rows):
            if r is not None:
                length = r[layer][0].shape[1]
                k[i, :, width - length : width] = r[layer][0]
                v[i, :, width - length : width] = r[layer][1]
        out.append((k, v, width))
    return out


def _distinct(keys: Iterable) -> tuple[list[int], list[int]]:
    """(index of each distinct key's first occurrence, position in that list of every key)."""
    first: dict = {}
    uniq: list[int] = []
    back: list[int] = []
    for i, k in enumerate(keys):
        if k not in first:
            first[k] = len(uniq)
            uniq.append(i)
        back.append(first[k])
    return uniq, back


@dataclass
class _Prefix:
    tokens: list[int]  # the ids whose keys/values are stored
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (kv_heads, len, head_dim)


class HFEngine:
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, keep_cache: bool = True,
                 max_padding: float | None = None):
        self.model = model.eval()
        # padding budget of a prefill group (see ``length_groups``): on CPU padded tokens cost
        # as much as real ones and small groups cost nothing extra; on a GPU one wide batch wins
        if max_padding is None:
            max_padding = 0.1 if next(model.parameters()).device.type == "cpu" else 1.0
        self.max_padding = max_padding
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.keep_cache = keep_cache
        self.generated_tokens = 0  # running count, for throughput metrics
        self.prefilled_tokens = 0  # tokens actually run through prefill (cache misses)
        self.generate_seconds = 0.0  # wall time inside generate / choose (the pipeline's timing metrics)
        self._prefixes: dict[str, _Prefix] = {}
        # transformers 5.x renamed `past_key_values` to `cache`; accept both.
        params = inspect.signature(type(model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    #: the policy arrives as merged weights (``update_weights``)
    syncs_adapters = False

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def update_adapter(self, save: Callable[[Path], Any]) -> str:
        raise NotImplementedError("the hf engine takes merged weights (update_weights), not LoRA adapters")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in params:
                    raise KeyError(f"update_weights: unknown parameter {name!r}")
                params[name].copy_(tensor.to(params[name].dtype))
        self._prefixes.clear()  # cached keys/values belong to the old weights

    def release(self, keys: Iterable[str]) -> None:
        """Forget the cached conversations ``keys`` (their episodes ended)."""
        for k in keys:
            self._prefixes.pop(k, None)

    def close(self) -> None:
        self._prefixes.clear()
        self.model = None  # type: ignore[assignment]

    def _stopped_by_string(self, ids: list[int], stops: list[str]) -> bool:
        # Leading whitespace does not count: "Action:" + "\n" + "go to ..." is not an empty reply.
        body = cast(str, self.tokenizer.decode(ids, skip_special_tokens=True)).lstrip()  # one sequence: a str
        return any(s in body for s in stops)

    def _forward(self, ids, attn, pos, cache) -> torch.Tensor:
        # logits_to_keep=1: only the last position's logits are used; computing the vocabulary
        # projection at every prefill position cost ~14 % of a SmolLM2 prefill
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True,
                         logits_to_keep=1, **{self._cache_kw: cache})
        return out.logits[:, -1, :].float()

    def _prefill(self, prompts: list[list[int]], keys: list[str] | None, reserve: int = 0):
        """Build the batch's cache and return (logits of the last prompt token, cache, attn,
        next_pos), one row per prompt; identical prompts are computed once (``_prefill_unique``)
        and their rows copied."""
        logits, cache, attn, next_pos, back = self._prefill_unique(prompts, keys, reserve)
        if len(back) == logits.shape[0]:
            return logits, cache, attn, next_pos
        idx = torch.tensor(back, device=logits.device)
        cache.batch_select_indices(idx)
        return logits[idx], cache, attn[idx], next_pos[idx]

    def _prefill_unique(self, prompts: list[list[int]], keys: list[str] | None, reserve: int = 0):
        """``_prefill`` of the distinct prompts only, and ``back``: the row of each prompt's copy.

        A GRPO group's episodes start from the same prompt (same task, same seed), and with a
        confident policy they often stay identical for turns: their prefill is one row's.
        """
        uniq, back = _distinct(tuple(p) for p in prompts)
        if len(uniq) < len(prompts):
            prompts = [prompts[i] for i in uniq]
            keys = [keys[i] for i in uniq] if keys is not None else None
        return (*self._prefill_distinct(prompts, keys, reserve), back)

    def _prefill_distinct(self, prompts: list[list[int]], keys: list[str] | None, reserve: int = 0):
        """Build the batch's cache and return (logits of the last prompt token, cache, attn, next_pos).

        Rows are prefilled in groups of similar new-token length (``length_groups``): one padded
        forward over a whole batch computed up to 2x the real tokens on multi-turn rollouts
        (observations of 100-380 tokens padded to the longest). The groups' keys/values are then
        laid out in one cache, ``[pad][cached prefix][new]`` per row, for the decode steps, with
        room for ``reserve`` more tokens (``ReservedLayer``: decode steps write in place).
        """
        n = len(prompts)
        reuse = [0] * n
        hits: list[_Prefix | None] = [None] * n
        if keys is not None and self.keep_cache:
            for i, (p, k) in enumerate(zip(prompts, keys)):
                pre = self._prefixes.get(k)
                if pre is not None and len(pre.tokens) < len(p) and p[: len(pre.tokens)] == pre.tokens:
                    reuse[i], hits[i] = len(pre.tokens), pre
        new = [p[c:] for p, c in zip(prompts, reuse)]
        self.prefilled_tokens += sum(len(x) for x in new)
        groups = length_groups([len(x) for x in new], self.max_padding)
        if len(groups) == 1:
            return self._prefill_rows(new, reuse, hits, reserve)
        device = self.device
        logits = None
        rows_kv: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = [None] * n
        for g in groups:
            lg, cache, attn, _ = self._prefill_rows([new[i] for i in g], [reuse[i] for i in g],
                                                    [hits[i] for i in g], 0)
            if logits is None:
                logits = lg.new_empty((n, lg.shape[-1]))
            logits[torch.tensor(g, device=lg.device)] = lg
            for j, i in enumerate(g):
                rows_kv[i] = _row_kv(cache, j, attn[j])
        total = [c + len(x) for c, x in zip(reuse, new)]
        width = max(total)
        data = _right_aligned(rows_kv, width, device, reserve)
        attn = torch.zeros((n, width), dtype=torch.long)
        for i, t in enumerate(total):
            attn[i, width - t:] = 1
        next_pos = torch.tensor(total)[:, None]
        return logits, reserved_cache(data, reserve), attn.to(device), next_pos.to(device)

    def _prefill_rows(self, new: list[list[int]], reuse: list[int], hits: list["_Prefix | None"], reserve: int):
        """One padded forward over ``new`` tokens after each row's cached prefix (``hits``,
        ``reuse`` tokens long); returns (last logits, cache with room for ``reserve`` more tokens,
        attention mask, next positions)."""
        device = self.device
        n = len(new)
        width_c = max(reuse)
        width_n = max(len(x) for x in new)
        ids = torch.full((n, width_n), self.pad_id, dtype=torch.long)
        attn_n = torch.zeros((n, width_n), dtype=torch.long)
        for i, x in enumerate(new):  # left padding: every row's next token is at the end
            ids[i, width_n - len(x):] = torch.tensor(x)
            attn_n[i, width_n - len(x):] = 1
        pos = (attn_n.cumsum(-1) - 1).clamp(min=0) + torch.tensor(reuse)[:, None]
        attn_c = torch.zeros((n, width_c), dtype=torch.long)
        cache = reserved_cache(None, reserve)
        if width_c:
            prefixes = [h.kv if h is not None else None for h in hits]
            cache = reserved_cache(_right_aligned(prefixes, width_c, device, width_n + reserve), reserve)
            for i, c in enumerate(reuse):
                attn_c[i, width_c - c:] = 1
        attn = torch.cat([attn_c, attn_n], dim=-1).to(device)
        logits = self._forward(ids.to(device), attn, pos.to(device), cache)
        return logits, cache, attn, pos[:, -1:].to(device) + 1

    def _save(self, key: str, tokens: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep a row's keys/values (``_row_kv``: boolean indexing already made them a copy, which
        later cache updates never write into) as the prefix of conversation ``key``.

        ``tokens`` is copied: a caller's prompt list is often the conversation itself, extended in
        place by the next turn (the rollout's ``ep.input_ids``). Stored by reference, the prefix
        grew with it, never matched as a strict prefix again, and every constrained turn
        re-prefilled its whole conversation (the base model's 32-task evaluation at horizon 5:
        47.6k tokens prefilled instead of 18.7k)."""
        if kv and kv[0][0].shape[1] == len(tokens):
            self._prefixes[key] = _Prefix(list(tokens), kv)

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 cache_keys: list[str] | None = None) -> list[Sample]:
        """One reply per prompt. With ``cache_keys`` (one per prompt, e.g. the episode id), the
        keys/values of each conversation are kept for its next, longer prompt."""
        t0 = time.perf_counter()
        try:
            return self._generate(prompts, params, cache_keys)
        finally:
            self.generate_seconds += time.perf_counter() - t0

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], params: SamplingParams,
                  cache_keys: list[str] | None) -> list[Sample]:
        if not prompts:
            return []
        check_prompts(prompts, cache_keys, params)
        keys = cache_keys if self.keep_cache else None
        n = len(prompts)
        logits, cache, attn, next_pos = self._prefill(prompts, keys, reserve=params.max_new_tokens)
        device = self.device
        draws = _Draws(params)
        stop_ids = set(params.stop_token_ids)
        out_ids: list[list[int]] = [[] for _ in range(n)]
        out_lps: list[list[float]] = [[] for _ in range(n)]
        reasons: list[str] = ["length"] * n
        alive = torch.arange(n)  # original row index of each row still in the batch

        def save_rows(rows_in_batch: list[int]) -> None:
            if keys is None:
                return
            for j in rows_in_batch:
                row = int(alive[j])
                # the cache holds the prompt and every sampled token but the last (not yet fed)
                self._save(keys[row], prompts[row] + out_ids[row][:-1], _row_kv(cache, j, attn[j]))

        for step in range(params.max_new_tokens):
            logp = torch.log_softmax(logits / params.temperature, dim=-1)
            if params.greedy:
                tok = logp.argmax(-1)
            else:
                probs = _top_p_filter(logp.exp(), params.top_p)
                tok = draws.pick(probs.cpu(), alive.tolist()).to(device)
            tok_lp = logp.gather(-1, tok[:, None]).squeeze(-1)
            keep: list[int] = []
            done: list[int] = []
            for j, row in enumerate(alive.tolist()):
                t = int(tok[j])
                out_ids[row].append(t)
                out_lps[row].append(float(tok_lp[j]))
                if t in stop_ids or (
                    params.stop_strings and self._stopped_by_string(out_ids[row], params.stop_strings)
                ):
                    reasons[row] = "stop"
                    done.append(j)
                else:
                    keep.append(j)
            if not keep or step + 1 >= params.max_new_tokens:
                save_rows(list(range(len(alive))))
                break
            if done:  # drop finished rows from the batch and the KV cache
                save_rows(done)
                sel = torch.tensor(keep, device=device)
                cache.batch_select_indices(sel)
                alive, tok, attn, next_pos = alive[sel.cpu()], tok[sel], attn[sel], next_pos[sel]
            attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=-1)
            logits = self._forward(tok[:, None], attn, next_pos, cache)
            next_pos = next_pos + 1

        self.generated_tokens += sum(len(x) for x in out_ids)
        return [Sample(out_ids[i], out_lps[i], reasons[i]) for i in range(n)]  # type: ignore[arg-type]

    def choose(self, prompts: list[list[int]], choices: list[list[list[int]]], params: SamplingParams,
               cache_keys: list[str] | None = None) -> list[Sample]:
        """For each prompt, one of its candidate replies ``choices[i]`` (token-id lists, e.g. every
        valid action in the reply format), drawn with probability proportional to the policy's
        probability of generating it at ``params.temperature`` -- sampling conditioned on the reply
        being one of the candidates (GLAM-style action scoring), each candidate's probability raised
        to ``1 / params.choice_temperature`` before normalising; ``params.greedy``: the most
        likely candidate (first on ties). ``top_p`` and the stop settings do not apply.

        The returned ``Sample`` holds the chosen ids and their per-token
        ``log_softmax(logits / T)``, exactly what ``generate`` would report had it sampled them,
        so the trainer's ratio and the stored tokens mean the same as in free generation, and
        every candidate's (``choice_logprobs``), from which the rollout renormalises under
        ``rollout.action_logprob: renormalised``.
        Cost: one prefill (kept caches reused as in ``generate``), then one forward over the
        distinct prefixes of every prompt's candidates (``_candidate_logprobs``).
        """
        t0 = time.perf_counter()
        try:
            return self._choose(prompts, choices, params, cache_keys)
        finally:
            self.generate_seconds += time.perf_counter() - t0

    @torch.no_grad()
    def _choose(self, prompts: list[list[int]], choices: list[list[list[int]]], params: SamplingParams,
                cache_keys: list[str] | None) -> list[Sample]:
        if not prompts:
            return []
        check_prompts(prompts, cache_keys, params)
        if len(choices) != len(prompts) or any(not c or any(not ids for ids in c) for c in choices):
            raise ValueError("choose: every prompt needs a non-empty list of non-empty candidates")
        keys = cache_keys if self.keep_cache else None
        logits, cache, attn, _, back = self._prefill_unique(prompts, keys)
        first = torch.log_softmax(logits / params.temperature, dim=-1)
        if keys is not None:  # the next turn's prompt extends this one (copied before scoring)
            kept: dict[int, list] = {}
            for r in range(len(prompts)):
                u = back[r]
                if u not in kept:
                    kept[u] = _row_kv(cache, u, attn[u])
                self._save(keys[r], prompts[r], kept[u])  # copies share tensors: never written in place
        # rows with the same prompt and candidates (a group's copies) are scored once
        scored, which = _distinct((back[r], tuple(map(tuple, choices[r]))) for r in range(len(prompts)))
        all_lps = self._candidate_logprobs(cache, attn, first, [choices[r] for r in scored],
                                           params.temperature, rows=[back[r] for r in scored])
        draws = _Draws(params)
        out: list[Sample] = []
        for r, (cands, k) in enumerate(zip(choices, which)):
            lps = all_lps[k]
            scores = torch.tensor([sum(x) for x in lps], dtype=torch.float64)
            if params.greedy:
                pick = int(scores.argmax())
            else:
                pick = int(draws.pick(torch.softmax(scores / params.choice_temperature, 0)[None], [r])[0])
            out.append(Sample(list(cands[pick]), list(lps[pick]), "stop", [list(x) for x in lps]))
        self.generated_tokens += sum(len(s.token_ids) for s in out)
        return out

    #: at most this many logits (rows x tree nodes x vocabulary) per scoring forward: rows are
    #: scored in chunks below it (256 MiB of fp32; 45 SmolLM2 rows of 30 nodes)
    max_scoring_logits = 1 << 26

    def _candidate_logprobs(self, cache: DynamicCache, attn: torch.Tensor, first: torch.Tensor,
                            choices: list[list[list[int]]], temperature: float,
                            rows: list[int] | None = None) -> list[list[list[float]]]:
        """Per entry ``i`` and candidate of ``choices[i]``, the log-probs of its tokens after the
        prompt of batch row ``r = rows[i]`` (default ``i``), whose keys/values are row ``r`` of
        ``cache`` (``attn`` marks its real positions: ``(rows, width)`` as ``_prefill`` returns
        them) and whose next-token log-probs are ``first[r]``.

        Each row's candidates are packed as a token tree (``candidate_tree``: a shared prefix such
        as " go to" is fed once) after its prompt, with a 4-D mask that lets each node see its
        prompt's real positions and its own ancestors only, and position ids by depth. Rows go
        through few forwards, not one per row (a SmolLM2 rollout turn spent 22 % of its time in
        per-row scoring calls): grouped by tree size (``length_groups``, as prefill is), because
        one forward padded to the largest tree computed twice the real nodes on BabyAI (3 valid
        actions in 6 nodes beside 16 in 55), then chunked under ``max_scoring_logits``.
        ``cache`` is not modified.
        """
        rows = list(range(len(choices))) if rows is None else rows
        out = [[[float(first[rows[i], c[0]])] for c in cands] for i, cands in enumerate(choices)]
        trees = [candidate_tree(c) for c in choices]
        sizes = [len(tr[0]) for tr in trees]
        vocab = self.model.get_output_embeddings().weight.shape[0]
        for group in length_groups(sizes, self.max_padding):
            t_max = sizes[group[0]]  # longest first
            if t_max == 0:  # single-token candidates only: ``first`` has them
                continue
            step = max(1, self.max_scoring_logits // (t_max * vocab))
            for a in range(0, len(group), step):
                self._score_trees(cache, attn, trees, choices, group[a:a + step], rows, t_max, temperature, out)
        self.prefilled_tokens += sum(sizes)
        return out

    def _score_trees(self, cache: DynamicCache, attn: torch.Tensor, trees: list, choices: list[list[list[int]]],
                     entries: list[int], rows: list[int], t_max: int, temperature: float,
                     out: list[list[list[float]]]) -> None:
        """One forward over the candidate trees of ``entries`` (each after the cached prompt of
        batch row ``rows[entry]``, padded to ``t_max`` nodes); appends each candidate's later
        tokens' log-probs to ``out[entry]``."""
        n, width = len(entries), attn.shape[1]
        device = self.device
        dtype = next(self.model.parameters()).dtype
        sel = torch.tensor([rows[e] for e in entries], device=attn.device)
        lengths = attn[sel].sum(-1).tolist()
        ids = torch.full((n, t_max), self.pad_id, dtype=torch.long)
        pos = torch.zeros((n, t_max), dtype=torch.long)
        allowed = torch.zeros((n, t_max, width + t_max), dtype=torch.bool)
        allowed[:, :, :width] = attn[sel].bool().cpu()[:, None, :]
        allowed[:, torch.arange(t_max), width + torch.arange(t_max)] = True  # each node (pads too) sees itself
        for i, r in enumerate(entries):
            tokens, parents, _ = trees[r]
            depth = [0] * len(tokens)
            for j, par in enumerate(parents):  # parents come before children: their rows are done
                depth[j] = depth[par] + 1 if par >= 0 else 1
                if par >= 0:
                    allowed[i, j, width:] |= allowed[i, par, width:]
            ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            pos[i, : len(tokens)] = torch.tensor([lengths[i] + d - 1 for d in depth], dtype=torch.long)
            pos[i, len(tokens):] = lengths[i]
        mask = torch.zeros((n, 1, t_max, width + t_max), dtype=dtype)
        mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
        sel = sel.to(device)
        # the rows' keys/values (index_select copies them, so ``cache`` is not modified); as
        # ``ReservedLayer``s, the tree's keys/values are added with one more copy, where a
        # ``DynamicCache`` built from them would copy the rows once more first
        data = [(k.index_select(0, sel), v.index_select(0, sel), width) for k, v in map(_layer_kv, cache.layers)]
        logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device),
                            position_ids=pos.to(device), use_cache=True, logits_to_keep=0,
                            **{self._cache_kw: reserved_cache(data, 0)}).logits.float()
        logp = torch.log_softmax(logits / temperature, dim=-1).cpu()
        for i, r in enumerate(entries):
            _, _, index = trees[r]
            for ci, c in enumerate(choices[r]):
                for j in range(1, len(c)):
                    out[r][ci].append(float(logp[i, index[tuple(c[:j])], c[j]]))


def candidate_tree(cands: list[list[int]]) -> tuple[list[int], list[int], dict[tuple[int, ...], int]]:
    """The distinct proper prefixes of the candidates as a tree, in breadth-first order:
    (token of each node, index of its parent or -1, node index of each prefix). A node stands for
    a prefix that some candidate extends, so its logits give that candidate's next token; a
    candidate's last token is never fed."""
    index: dict[tuple[int, ...], int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    for d in range(1, max(len(c) for c in cands)):
        for c in cands:
            if len(c) > d and tuple(c[:d]) not in index:
                index[tuple(c[:d])] = len(tokens)
                tokens.append(c[d - 1])
                parents.append(index[tuple(c[: d - 1])] if d > 1 else -1)
    return tokens, parents, index
