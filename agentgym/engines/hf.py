"""Batched sampling with transformers on CPU (or one GPU): the default rollout engine.

A hand-written decode loop instead of ``model.generate`` so that the log-probs are exactly
those of the sampling distribution (``log_softmax(logits / T)``), sampling is seeded through
an explicit ``torch.Generator`` (same seed + same prompts -> same tokens), and rows that finish
early leave the batch (their KV-cache rows are dropped) instead of burning compute.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from agentgym.engines.base import Sample, SamplingParams


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    if top_p >= 1.0:
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the most likely token
    sorted_p = sorted_p * keep
    out = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return out / out.sum(-1, keepdim=True)


class HFEngine:
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.generated_tokens = 0  # running count, for throughput metrics
        # transformers 5.x renamed `past_key_values` to `cache`; accept both.
        params = inspect.signature(type(model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in params:
                    raise KeyError(f"update_weights: unknown parameter {name!r}")
                params[name].copy_(tensor.to(params[name].dtype))

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]

    def _stopped_by_string(self, ids: list[int], stops: list[str]) -> bool:
        tail = self.tokenizer.decode(ids[-16:], skip_special_tokens=True)
        return any(s in tail for s in stops)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Sample]:
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("generate: every prompt needs at least one token")
        device = self.device
        n = len(prompts)
        width = max(len(p) for p in prompts)
        input_ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row's next token is at the end
            input_ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        input_ids, attn = input_ids.to(device), attn.to(device)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        gen = torch.Generator(device="cpu").manual_seed(int(params.seed))
        stop_ids = set(params.stop_token_ids)

        out_ids: list[list[int]] = [[] for _ in range(n)]
        out_lps: list[list[float]] = [[] for _ in range(n)]
        reasons: list[str] = ["length"] * n
        alive = torch.arange(n)  # original row index of each row still in the batch
        cache = DynamicCache()
        logits = self.model(
            input_ids=input_ids, attention_mask=attn, position_ids=positions,
            use_cache=True, **{self._cache_kw: cache},
        ).logits[:, -1, :].float()
        next_pos = positions[:, -1:] + 1

        for _ in range(params.max_new_tokens):
            logp = torch.log_softmax(logits / params.temperature, dim=-1)
            if params.greedy:
                tok = logp.argmax(-1)
            else:
                probs = _top_p_filter(logp.exp(), params.top_p)
                tok = torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(device)
            tok_lp = logp.gather(-1, tok[:, None]).squeeze(-1)
            keep: list[int] = []
            for j, row in enumerate(alive.tolist()):
                t = int(tok[j])
                out_ids[row].append(t)
                out_lps[row].append(float(tok_lp[j]))
                if t in stop_ids or (
                    params.stop_strings and self._stopped_by_string(out_ids[row], params.stop_strings)
                ):
                    reasons[row] = "stop"
                else:
                    keep.append(j)
            if not keep or len(out_ids[int(alive[keep[0]])]) >= params.max_new_tokens:
                break
            if len(keep) < len(alive):  # drop finished rows from the batch and the KV cache
                sel = torch.tensor(keep, device=device)
                cache.batch_select_indices(sel)
                alive, tok, attn, next_pos = alive[sel.cpu()], tok[sel], attn[sel], next_pos[sel]
            attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=-1)
            logits = self.model(
                input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos,
                use_cache=True, **{self._cache_kw: cache},
            ).logits[:, -1, :].float()
            next_pos = next_pos + 1

        self.generated_tokens += sum(len(x) for x in out_ids)
        return [Sample(out_ids[i], out_lps[i], reasons[i]) for i in range(n)]  # type: ignore[arg-type]
