"""DeepSpeed policy trainer: PPO-clip updates on multi-turn batches.

World size 1 runs in the caller's process (the Prefect flow's); world size N > 1 runs as a
resident group of N ranks (``agentgym.distributed.ResidentGroup``), each rank holding a
``PolicyTrainer`` over the same code path. The update honours ``ppo_epochs`` and
``mini_batches`` (``ppo_epochs * mini_batches`` optimizer steps per batch: the original
AgentGym-RL ignored ``ppo_epochs``), micro-batches inside a mini-batch are accumulated with
DeepSpeed's manual accumulation boundary (gradient accumulation; the learning-rate schedule
steps once per optimizer step), and each micro-batch's loss is weighted by its share of the
mini-batch so the aggregate is exact for every loss mode.

Data parallel: every rank sees the whole batch and the same permutation; rank r trains on the
r-th of N slices of each mini-batch. A micro-batch's weight is still its share of the *whole*
mini-batch, and its loss is multiplied by N, because DeepSpeed averages gradients over ranks:
(1/N) * sum_r N * sum_micro w * grad = the full mini-batch gradient, the same as one process
(only float summation order differs). Ranks run the same number of micro-batches (a rank
with fewer pads with zero-weight passes) so ZeRO-3's per-forward collectives line up.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from agentgym import algorithms as A
from agentgym.config import AlgorithmConfig, TrainerConfig

CHECKPOINT_TAG = "ds"  # DeepSpeed's tag (subfolder) inside a checkpoint folder
_RESERVED = "_agentgym"  # our own entry in DeepSpeed's client_state
_WEIGHT_LOADS = 0  # policy weights read from disk by this process (from_pretrained, checkpoints)


def weight_loads() -> int:
    """How many times this process read policy weights from disk (model folder or checkpoint)."""
    return _WEIGHT_LOADS


def _count_weight_load() -> None:
    global _WEIGHT_LOADS
    _WEIGHT_LOADS += 1


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
    if not torch.cuda.is_available():
        # DeepSpeed's CPU shared-memory comm op serves only ``inference_all_reduce`` (tensor-
        # parallel inference); training collectives (all-reduce, reduce-scatter, all-gather of
        # ZeRO) go through gloo whether it is built or not. So skip its ~90 s first-time C++
        # compile at every world size: it would cost each fresh machine (and rank) a compiler
        # run and buy training nothing.
        ds_torch_comm.build_shm_op = lambda: None
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def lr_lambda(cfg: TrainerConfig):
    """Multiplier of ``learning_rate`` for the optimizer step with 0-based index ``step``."""
    warm, total, floor = cfg.lr_warmup_steps, cfg.lr_decay_steps, cfg.lr_min_ratio

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


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


class _LogprobModel(torch.nn.Module):
    """What the DeepSpeed engine wraps: the policy, with ``token_logprobs`` as its forward.

    The forward must run through ``engine(...)``: DeepSpeed does per-micro-batch bookkeeping
    there (ZeRO-3 counts micro-steps to accumulate rather than overwrite gradient partitions,
    and hooks the outputs to start each backward). Calling the policy's submodules directly
    silently dropped accumulated gradients under ZeRO-3."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, input_ids, attention_mask, loss_mask, temperature: float, with_entropy: bool):
        batch = TrainBatch(input_ids, attention_mask, loss_mask, loss_mask, loss_mask)
        return token_logprobs(self.policy, batch, temperature, with_entropy)


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
        self.model_path = str(model_path)
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, local_files_only=True)
        _count_weight_load()
        if trainer.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        model.config.use_cache = False
        self.lora = trainer.lora is not None
        if trainer.lora is not None:
            from peft import LoraConfig, get_peft_model

            lc = trainer.lora
            model = get_peft_model(model, LoraConfig(
                r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout, bias="none",
                target_modules=lc.target_modules, modules_to_save=list(lc.modules_to_save) or None,
                task_type="CAUSAL_LM",
            ))
            if trainer.gradient_checkpointing:
                model.enable_input_require_grads()  # frozen embeddings: checkpoints need a grad path
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
            [p for p in model.parameters() if p.requires_grad],
            lr=trainer.learning_rate, weight_decay=trainer.weight_decay,
        )
        schedule = lr_lambda(trainer)
        # A callable: DeepSpeed builds the scheduler on the optimizer it really steps, steps it
        # at each accumulation boundary (= optimizer step) and keeps it in its checkpoints.
        self.engine, self.optimizer, _, self.lr_scheduler = deepspeed.initialize(
            model=_LogprobModel(model), optimizer=optimizer, config=ds_config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
        )
        if self.lora:
            self._adapter_only_checkpoints()
        self.ref: torch.nn.Module | None = None
        if algorithm.kl_coef > 0:
            dtype = torch.bfloat16 if trainer.bf16 else torch.float32
            self.ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, local_files_only=True)
            self.ref.eval().requires_grad_(False)
        self.optimizer_steps = 0

    def _adapter_only_checkpoints(self) -> None:
        """DeepSpeed's ``exclude_frozen_parameters`` drops frozen parameters by their first name
        only, so a tied alias (lm_head.weight = embed_tokens.weight) stays in LoRA checkpoints;
        drop every name of a frozen tensor."""
        engine = self.engine
        original = engine.module_state_dict

        def module_state_dict(*args, exclude_frozen_parameters=False, **kwargs):
            sd = original(*args, exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)
            if exclude_frozen_parameters:
                for n, p in engine.module.named_parameters(remove_duplicate=False):
                    if not p.requires_grad:
                        sd.pop(n, None)
            return sd

        engine.module_state_dict = module_state_dict

    # -- weights ---------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        """The policy (a peft model with LoRA) inside the engine."""
        return self.engine.module.policy

    @property
    def zero3(self) -> bool:
        return self.cfg.zero_stage == 3

    def _gathered(self, params: list[torch.nn.Parameter]):
        """ZeRO-3 holds 1/N of each parameter per rank: gather the full tensors (a collective:
        every rank must enter) for the duration of the block. A no-op below stage 3."""
        if not self.zero3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs of the current policy under the base model's parameter names,
        for ``InferenceEngine.update_weights``: full tensors (gathered under ZeRO-3, so every
        rank must iterate to the end) and, with LoRA, merged (W + alpha/r * B A), so the
        inference engine needs no peft. At ZeRO 0-2 without LoRA the tensors are views of the
        live parameters (no copy); otherwise they are fresh tensors."""
        if self.lora:
            yield from self._merged_weights()
            return
        for name, p in self.module.named_parameters():
            if self.zero3:
                with self._gathered([p]):
                    t = p.detach().clone()
                yield name, t
            else:
                yield name, p.detach()

    def _merged_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        from peft.tuners.lora import LoraLayer

        base = self.module.get_base_model()
        adapted = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
        handled: set[str] = set()
        for name, m in adapted.items():
            params = [p for p in m.parameters()]
            with self._gathered(params), torch.no_grad():
                w = m.base_layer.weight
                merged = (w.float() + m.get_delta_weight("default").float()).to(w.dtype)
                bias = None if m.base_layer.bias is None else m.base_layer.bias.detach().clone()
            handled.add(f"{name}.base_layer.weight")
            yield f"{name}.weight", merged
            if bias is not None:
                handled.add(f"{name}.base_layer.bias")
                yield f"{name}.bias", bias
        for name, p in base.named_parameters():
            # lora_A/B are merged above; modules_to_save keep a frozen original_module beside
            # the trained copy (modules_to_save.default), which is the one to export.
            if name in handled or ".lora_" in name or ".original_module." in name:
                continue
            with self._gathered([p]):
                t = p.detach().clone() if self.zero3 else p.detach()
            yield name.replace(".base_layer.", ".").replace(".modules_to_save.default.", "."), t

    def save_hf(self, out_dir: str | Path, tokenizer: PreTrainedTokenizerBase | None) -> Path:
        """Export the policy as an HF folder (merged weights with LoRA). Under ZeRO-3 every rank
        must call this (the weights are gathered); only rank 0 writes. ``tokenizer`` None: the
        caller writes it."""
        out = Path(out_dir)
        if not self.lora and not self.zero3:
            if self.rank == 0:
                out.mkdir(parents=True, exist_ok=True)
                self.module.save_pretrained(out, safe_serialization=True)
        else:
            state = dict(self.named_weights())
            if self.rank == 0:
                out.mkdir(parents=True, exist_ok=True)
                base = self.module.get_base_model() if self.lora else self.module
                base.save_pretrained(out, state_dict=state, safe_serialization=True)
        if tokenizer is not None and self.rank == 0:
            tokenizer.save_pretrained(out)
        return out

    def save_checkpoint(self, ckpt_dir: str | Path, client_state: dict[str, Any] | None = None) -> Path:
        """Everything an exact resume needs: model (LoRA: adapters only), optimizer, learning-rate
        schedule, DeepSpeed's step counters (DeepSpeed's own format under ``{dir}/ds``), this
        trainer's step count and every rank's python/numpy/torch RNG states. All ranks must call
        it; with several hosts ``ckpt_dir`` must be on a shared filesystem. ``client_state``
        must hold plain values (numbers, strings, lists, dicts, tensors)."""
        ckpt = Path(ckpt_dir)
        state = dict(client_state or {})
        state[_RESERVED] = {"optimizer_steps": self.optimizer_steps, "world_size": self.world_size,
                            "keys": sorted(client_state or {})}
        self.engine.save_checkpoint(str(ckpt), tag=CHECKPOINT_TAG, client_state=state,
                                    exclude_frozen_parameters=self.lora)
        torch.save(rng_state(), ckpt / CHECKPOINT_TAG / f"rng_rank{self.rank}.pt")
        torch.distributed.barrier()
        return ckpt

    def load_checkpoint(self, ckpt_dir: str | Path) -> dict[str, Any]:
        """Restore a ``save_checkpoint`` folder (made with the same base model, config and world
        size) into this trainer; returns the caller's ``client_state``."""
        ckpt = Path(ckpt_dir)
        if not (ckpt / CHECKPOINT_TAG).is_dir():
            raise FileNotFoundError(f"{ckpt} holds no trainer checkpoint (no {CHECKPOINT_TAG}/ folder)")
        path, state = self.engine.load_checkpoint(
            str(ckpt), tag=CHECKPOINT_TAG, load_module_strict=not self.lora,
            load_optimizer_states=True, load_lr_scheduler_states=True,
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {ckpt}")
        _count_weight_load()
        state = dict(state or {})
        ours = state.pop(_RESERVED, {})
        if ours.get("world_size", self.world_size) != self.world_size:
            raise ValueError(f"checkpoint {ckpt} was written by {ours['world_size']} ranks; this "
                             f"trainer has {self.world_size} (resume with the same world_size)")
        self.optimizer_steps = int(ours.get("optimizer_steps", 0))
        rng_file = ckpt / CHECKPOINT_TAG / f"rng_rank{self.rank}.pt"
        set_rng_state(torch.load(rng_file, weights_only=False))
        # DeepSpeed returns client_state with its own keys mixed in: keep only the caller's.
        keys = ours.get("keys", list(state))
        state = {k: state[k] for k in keys if k in state}
        return state

    def close(self) -> None:
        """Nothing to release in-process (the interface matches ``ResidentGroup.close``)."""

    # -- update ----------------------------------------------------------------------------
    def _micro_loss(self, mb: TrainBatch, norm_length: int) -> tuple[torch.Tensor, dict[str, float]]:
        agg = {"loss_agg": self.algo.loss_agg, "norm_length": norm_length}
        lp, ent = self.engine(mb.input_ids, mb.attention_mask, mb.loss_mask, self.temperature, True)
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
        """``ppo_epochs`` passes x ``mini_batches`` optimizer steps over ``batch``.

        With N ranks every rank gets the same ``batch`` and ``seed`` and trains on its slice
        (see the module docstring). Metrics: per-micro-batch means (``policy_loss``, ``entropy``,
        ...) over all ranks, ``loss`` = the exact mini-batch objective (weighted sum over its
        micro-batches and ranks) averaged over optimizer steps, ``lr`` of the last step.
        """
        self.engine.train()
        gen = torch.Generator().manual_seed(seed)
        history: dict[str, list[float]] = {}
        step_losses: list[float] = []
        lr = float("nan")
        steps = 0
        n, rank = self.world_size, self.rank
        mbs = self.cfg.micro_batch_size
        for _ in range(self.algo.ppo_epochs):
            order = torch.randperm(len(batch), generator=gen)
            for chunk in torch.tensor_split(order, self.algo.mini_batches):
                if len(chunk) == 0:
                    continue
                mini = batch.select(chunk)
                shares = torch.tensor_split(torch.arange(len(mini)), n)
                micro = list(torch.split(shares[rank], mbs)) if len(shares[rank]) else []
                passes = max(1, max(math.ceil(len(sh) / mbs) for sh in shares))
                step_loss = 0.0
                for k in range(passes):
                    self.engine.set_gradient_accumulation_boundary(k == passes - 1)
                    if k < len(micro):
                        mb = mini.select(micro[k])
                        w = self._weight(mb, mini)
                    else:  # this rank's slice ran out: a zero-weight pass keeps collectives aligned
                        mb, w = mini.select([0]), 0.0
                    loss, m = self._micro_loss(mb, norm_length=batch.input_ids.shape[1])
                    self.engine.backward(loss * (w * n), scale_wrt_gas=False)
                    if k < len(micro):
                        step_loss += w * float(loss.detach())
                        for key, v in m.items():
                            history.setdefault(key, []).append(v)
                lr = float(self.optimizer.param_groups[0]["lr"])
                self.engine.step()
                step_losses.append(step_loss)
                gn = self.engine.get_global_grad_norm()
                if gn is not None:
                    history.setdefault("grad_norm", []).append(float(gn))
                steps += 1
        if n > 1:  # exact objective: sum over ranks; micro-batch metrics: pooled over ranks
            t = torch.tensor(step_losses, dtype=torch.float64)
            torch.distributed.all_reduce(t)
            step_losses = t.tolist()
            pooled: list[dict[str, list[float]]] = [None] * n  # type: ignore[list-item]
            local = {k: v for k, v in history.items() if k != "grad_norm"}
            torch.distributed.all_gather_object(pooled, local)
            merged: dict[str, list[float]] = {}
            for h in pooled:
                for k, v in h.items():
                    merged.setdefault(k, []).extend(v)
            if "grad_norm" in history:
                merged["grad_norm"] = history["grad_norm"]
            history = merged
        self.optimizer_steps += steps
        out = {k: float(np.nanmean(v)) if not all(np.isnan(v)) else float("nan") for k, v in history.items()}
        out["loss"] = float(np.mean(step_losses)) if step_losses else float("nan")
        out["lr"] = lr
        out["optimizer_steps"] = float(steps)
        return out


def create_trainer(
    model_path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    trainer: TrainerConfig,
    algorithm: AlgorithmConfig,
    temperature: float = 1.0,
    seed: int = 0,
):
    """The trainer for ``trainer.world_size``: a ``PolicyTrainer`` in this process at 1, a
    ``ResidentGroup`` of N ranks (same interface) above."""
    if trainer.world_size > 1:
        from agentgym.distributed import ResidentGroup

        return ResidentGroup(model_path, tokenizer, trainer, algorithm, temperature=temperature, seed=seed)
    return PolicyTrainer(model_path, tokenizer, trainer, algorithm, temperature=temperature, seed=seed)
