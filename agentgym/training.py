"""DeepSpeed policy trainer: PPO-clip updates on multi-turn batches.

World size 1 runs in the caller's process (the Prefect flow's). The update honours
``ppo_epochs`` and ``mini_batches`` (``ppo_epochs * mini_batches`` optimizer steps per batch:
the original AgentGym-RL ignored ``ppo_epochs``), micro-batches inside a mini-batch are
accumulated with DeepSpeed's manual accumulation boundary, and each micro-batch's loss is
weighted by its share of the mini-batch so the aggregate is exact for every loss mode.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from agentgym import algorithms as A
from agentgym.config import AlgorithmConfig, TrainerConfig


@dataclass
class TrainBatch:
    """Padded tensors for one update. Shapes (B, T); mask meaning as in ``agentgym.types``."""

    input_ids: torch.Tensor  # long, right-padded with pad id
    attention_mask: torch.Tensor  # 1 = real token
    loss_mask: torch.Tensor  # 1 = policy-sampled token
    old_logprobs: torch.Tensor  # float, 0 where loss_mask == 0
    advantages: torch.Tensor  # float, 0 where loss_mask == 0

    @classmethod
    def from_rows(cls, rows: list[dict], pad_id: int) -> "TrainBatch":
        """``rows``: dicts with input_ids, loss_mask, old_logprobs, advantages (equal lengths)."""
        if not rows:
            raise ValueError("TrainBatch.from_rows: no rows")
        width = max(len(r["input_ids"]) for r in rows)
        b = len(rows)
        ids = torch.full((b, width), pad_id, dtype=torch.long)
        attn = torch.zeros((b, width), dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.float32)
        old = torch.zeros((b, width), dtype=torch.float32)
        adv = torch.zeros((b, width), dtype=torch.float32)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            if not (len(r["loss_mask"]) == len(r["old_logprobs"]) == len(r["advantages"]) == n):
                raise ValueError(f"row {i}: token columns differ in length")
            ids[i, :n] = torch.as_tensor(r["input_ids"], dtype=torch.long)
            attn[i, :n] = 1
            mask[i, :n] = torch.as_tensor(r["loss_mask"], dtype=torch.float32)
            old[i, :n] = torch.as_tensor(r["old_logprobs"], dtype=torch.float32)
            adv[i, :n] = torch.as_tensor(r["advantages"], dtype=torch.float32)
        return cls(ids, attn, mask, old, adv)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: torch.Tensor | list[int]) -> "TrainBatch":
        idx = torch.as_tensor(idx, dtype=torch.long)
        return TrainBatch(*(t[idx] for t in (
            self.input_ids, self.attention_mask, self.loss_mask, self.old_logprobs, self.advantages)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process_dist() -> None:
    """DeepSpeed wants a process group even for one rank; set one up on loopback."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    import importlib

    import deepspeed

    # (`deepspeed.comm.torch` as an attribute is the torch package itself: import the module.)
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    if int(os.environ["WORLD_SIZE"]) == 1:
        # The shared-memory all-reduce op only speeds up collectives between CPU ranks; at
        # world size 1 there are none, so skip its ~90 s first-time C++ compile.
        ds_torch_comm.build_shm_op = lambda: None
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def token_logprobs(
    model: torch.nn.Module, batch: TrainBatch, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, T) of each token given its prefix, 0 at position 0 and masked positions.

    Only the hidden states of policy tokens go through the LM head (the vocabulary projection
    dominates memory for long multi-turn conversations).
    """
    core = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    head = model.get_output_embeddings()
    hidden = core(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    target_mask = batch.loss_mask[:, 1:].bool()  # token t+1 is predicted from position t
    h = hidden[:, :-1][target_mask]
    logits = head(h).float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    targets = batch.input_ids[:, 1:][target_mask]
    lp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    out = torch.zeros(batch.input_ids.shape, dtype=lp.dtype, device=lp.device)
    out[:, 1:][target_mask] = lp
    ent = None
    if with_entropy:
        ent_tok = -(logp_all.exp() * logp_all).sum(-1)
        ent = torch.zeros_like(out)
        ent[:, 1:][target_mask] = ent_tok
    return out, ent


class PolicyTrainer:
    """A DeepSpeed engine over the policy, plus a frozen reference model when KL is used."""

    def __init__(
        self,
        model_path: str | Path,
        tokenizer: PreTrainedTokenizerBase,
        trainer: TrainerConfig,
        algorithm: AlgorithmConfig,
        temperature: float = 1.0,
        seed: int = 0,
    ):
        import deepspeed

        init_single_process_dist()
        seed_everything(seed)
        self.cfg, self.algo, self.temperature = trainer, algorithm, temperature
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.seed = seed
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, local_files_only=True)
        if trainer.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        model.config.use_cache = False
        ds_config = {
            "train_micro_batch_size_per_gpu": trainer.micro_batch_size,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": trainer.grad_clip,
            "zero_optimization": {"stage": trainer.zero_stage},
            "bf16": {"enabled": trainer.bf16},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=trainer.learning_rate, weight_decay=trainer.weight_decay
        )
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_config
        )
        self.ref: torch.nn.Module | None = None
        if algorithm.kl_coef > 0:
            dtype = torch.bfloat16 if trainer.bf16 else torch.float32
            self.ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, local_files_only=True)
            self.ref.eval().requires_grad_(False)
        self.optimizer_steps = 0

    # -- weights ---------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def named_weights(self):
        """(name, tensor) pairs of the current policy, for ``InferenceEngine.update_weights``."""
        for name, p in self.module.named_parameters():
            yield name, p.detach()

    def save_hf(self, out_dir: str | Path, tokenizer: PreTrainedTokenizerBase) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.module.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        return out

    # -- update ----------------------------------------------------------------------------
    def _micro_loss(self, mb: TrainBatch, norm_length: int) -> tuple[torch.Tensor, dict[str, float]]:
        agg = {"loss_agg": self.algo.loss_agg, "norm_length": norm_length}
        lp, ent = token_logprobs(self.module, mb, self.temperature, with_entropy=True)
        loss, m = A.policy_loss(
            lp, mb.old_logprobs, mb.advantages, mb.loss_mask,
            clip_low=self.algo.clip_low, clip_high=self.algo.clip_high,
            dual_clip=self.algo.dual_clip, **agg,
        )
        metrics = {"policy_loss": float(loss.detach()), **m}
        ent_term = A.aggregate_loss(ent, mb.loss_mask, self.algo.loss_agg, norm_length=norm_length)
        metrics["entropy"] = float(ent_term.detach())
        if self.algo.entropy_coef:
            loss = loss - self.algo.entropy_coef * ent_term
        if self.ref is not None:
            with torch.no_grad():
                ref_lp, _ = token_logprobs(self.ref, mb, self.temperature, False)
            kl = A.kl_penalty(lp, ref_lp, self.algo.kl_estimator)
            kl_term = A.aggregate_loss(kl, mb.loss_mask, self.algo.loss_agg, norm_length=norm_length)
            loss = loss + self.algo.kl_coef * kl_term
            metrics["kl"] = float(kl_term.detach())
        return loss, metrics

    def _weight(self, mb: TrainBatch, mini: TrainBatch) -> float:
        """Share of the mini-batch loss one micro-batch carries, so that the sum of weighted
        micro-batch losses equals the mini-batch loss exactly for every aggregation mode."""
        mode = self.algo.loss_agg
        if mode == "token-mean":
            return float(mb.loss_mask.sum() / mini.loss_mask.sum().clamp(min=1))
        if mode == "seq-mean-token-mean":  # rows without policy tokens are left out
            rows = lambda b: float((b.loss_mask.sum(-1) > 0).sum())  # noqa: E731
            return rows(mb) / max(rows(mini), 1.0)
        if mode == "seq-mean-token-sum":
            return len(mb) / len(mini)
        return 1.0  # seq-mean-token-sum-norm is a sum over rows with a fixed divisor

    def train_on_batch(self, batch: TrainBatch, seed: int = 0) -> dict[str, float]:
        """``ppo_epochs`` passes x ``mini_batches`` optimizer steps over ``batch``."""
        self.engine.train()
        gen = torch.Generator().manual_seed(seed)
        history: dict[str, list[float]] = {}
        steps = 0
        for _ in range(self.algo.ppo_epochs):
            order = torch.randperm(len(batch), generator=gen)
            for chunk in torch.tensor_split(order, self.algo.mini_batches):
                if len(chunk) == 0:
                    continue
                mini = batch.select(chunk)
                micro = list(torch.split(torch.arange(len(mini)), self.cfg.micro_batch_size))
                for k, idx in enumerate(micro):
                    mb = mini.select(idx)
                    self.engine.set_gradient_accumulation_boundary(k == len(micro) - 1)
                    loss, m = self._micro_loss(mb, norm_length=batch.input_ids.shape[1])
                    self.engine.backward(loss * self._weight(mb, mini), scale_wrt_gas=False)
                    for key, v in m.items():
                        history.setdefault(key, []).append(v)
                self.engine.step()
                gn = self.engine.get_global_grad_norm()
                if gn is not None:
                    history.setdefault("grad_norm", []).append(float(gn))
                steps += 1
        self.optimizer_steps += steps
        out = {k: float(np.nanmean(v)) if not all(np.isnan(v)) else float("nan") for k, v in history.items()}
        out["optimizer_steps"] = float(steps)
        return out


def create_trainer(
    model_path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    trainer: TrainerConfig,
    algorithm: AlgorithmConfig,
    temperature: float = 1.0,
    seed: int = 0,
) -> PolicyTrainer:
    """The trainer for ``trainer.world_size``: in-process at 1 (multi-rank: see docs)."""
    if trainer.world_size != 1:
        raise NotImplementedError("trainer.world_size > 1 is not available yet")
    return PolicyTrainer(model_path, tokenizer, trainer, algorithm, temperature=temperature, seed=seed)
