"""DeepSpeed policy trainer: PPO-clip updates on multi-turn batches.

World size 1 runs in the caller's process (the Prefect flow's); world size N > 1 runs as N
Ray actors (``agentgym.cluster.trainer_group.RayTrainerGroup``), each rank holding a
``PolicyTrainer`` over the same code path. Both implement ``agentgym.training.protocol.Trainer``. The update honours ``ppo_epochs`` and
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

Critic (``algorithm.critic``, estimator gae): ``separate`` is a second DeepSpeed engine (the
base model's transformer plus a linear value head, its own AdamW) stepped once per policy
optimizer step on the same micro-batches and weights; ``shared`` is a value head inside the
policy's engine whose value loss joins the policy loss. Values ``V[:, t]`` are read from the
hidden state at ``t - 1`` (the prefix the token at ``t`` was sampled from), aligned with
``token_logprobs``. Old values (GAE's, and the value clip's reference) come with the batch or
are computed before the first epoch; exports write the critic to ``critic/`` beside the policy.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Protocol, cast

import numpy as np
import torch
from transformers import AutoModel, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from agentgym import algorithms as A
from agentgym.config import AlgorithmConfig, TrainerConfig
from agentgym.infra.diskspace import disk_errors
from agentgym.models.hardware import resolve_bf16
from agentgym.patches.deepspeed import exclude_frozen_aliases
from agentgym.store.trajectory_store import TrajectoryStore
from agentgym.training.batch import TrainBatch
from agentgym.training.finite import FiniteWatch, NonFiniteTrainingError
from agentgym.training.forward import LogprobModel, ValueModel, token_logprobs
from agentgym.training.dist_env import init_single_process_dist
from agentgym.training.seeding import rng_state, seed_everything, set_rng_state
from agentgym.training.zero_stage import CHECKPOINT_TAG, STATE_FILE, checkpoint_stages, resolve_zero_stage
from agentgym.training.value_head import CRITIC_DIR, VALUE_HEAD_FILE, load_value_head, new_value_head, read_critic_folder

if TYPE_CHECKING:
    from agentgym.training.forward import Policy

log = logging.getLogger(__name__)
# what a full disk during an export or checkpoint asks the user to do
_NO_SPACE_FIX = ("free space on that disk (a checkpoint is written under TMPDIR, then copied to "
                 "the MLflow artifact store), then re-run: it resumes from the last checkpoint")
_RESERVED = "_agentgym"  # our own entry in DeepSpeed's client_state
_WEIGHT_LOADS = 0  # policy weights read from disk by this process (from_pretrained, checkpoints)


def weight_loads() -> int:
    """How many times this process read policy weights from disk (model folder or checkpoint)."""
    return _WEIGHT_LOADS


def _count_weight_load() -> None:
    global _WEIGHT_LOADS
    _WEIGHT_LOADS += 1


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


def freeze_below(model: PreTrainedModel, train_layers: int) -> None:
    """Train only the top ``train_layers`` decoder layers and the final norm: the embeddings
    (tied to the LM head in small models) and the layers below are frozen, so the backward pass
    stops at the lowest trained layer (bench/README.md, section 4, has what it buys on SmolLM2)."""
    layers = model.get_decoder().layers
    if not 1 <= train_layers <= len(layers):
        raise ValueError(f"trainer.train_layers={train_layers}: the model has {len(layers)} decoder "
                         f"layers; give 1..{len(layers)} or null (train all)")
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in layers[len(layers) - train_layers:]:
        for p in layer.parameters():
            p.requires_grad_(True)
    for p in model.get_decoder().norm.parameters():
        p.requires_grad_(True)


class PadTokenSource(Protocol):
    """What ``PolicyTrainer`` reads of its tokenizer: the pad token id (a Ray rank actor gets only
    that, ``agentgym.cluster.trainer_group.TrainerRank``)."""

    @property
    def pad_token_id(self) -> int | None: ...


def _unreported_grad_norm(engine: Any) -> float | None:
    """The gradient norm before clipping, where DeepSpeed will not report it: at ZeRO-0 in fp32
    it clips through ``clip_grad_norm_`` and drops the norm (``get_global_grad_norm()`` stays None;
    its ZeRO and bf16 optimizers keep theirs). None where DeepSpeed reports it. Call before
    ``engine.step()``. The gradients are all-reduced by then, so the local norm is the global one."""
    if engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled():
        return None
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0


class PolicyTrainer:
    """A DeepSpeed engine over the policy, plus a frozen reference model when KL is used and a
    critic (a second engine, or a value head in the policy's) for estimator gae."""

    def __init__(
        self,
        model_path: str | Path,
        tokenizer: PadTokenSource,
        trainer: TrainerConfig,
        algorithm: AlgorithmConfig,
        temperature: float = 1.0,
        seed: int = 0,
        action_temperature: float = 1.0,
    ):
        import deepspeed

        init_single_process_dist()
        seed_everything(seed)
        trainer = resolve_zero_stage(trainer)  # auto without a checkpoint hint: create_trainer gives one
        self.cfg, self.algo, self.temperature = trainer, algorithm, temperature
        self.action_temperature = action_temperature  # rollout.action_temperature: the tempered choice's log-probs
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
        if trainer.train_layers is not None:
            freeze_below(model, trainer.train_layers)
        self.lora = trainer.lora is not None
        policy: Policy = model
        if trainer.lora is not None:
            from peft import LoraConfig, get_peft_model

            lc = trainer.lora
            policy = get_peft_model(model, LoraConfig(
                # peft annotates lora_alpha as int; it scales by lora_alpha / r, a float alike
                r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout, bias="none",  # type: ignore[arg-type]
                target_modules=lc.target_modules, modules_to_save=list(lc.modules_to_save) or None,
                task_type="CAUSAL_LM",
            ))
            if trainer.gradient_checkpointing:
                policy.enable_input_require_grads()  # frozen embeddings: checkpoints need a grad path
        self.critic_mode = algorithm.critic.model
        ds_config = {
            "train_micro_batch_size_per_gpu": trainer.micro_batch_size,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": trainer.grad_clip,
            "zero_optimization": {"stage": trainer.zero_stage},
            "bf16": {"enabled": resolve_bf16(trainer.bf16)},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        groups = [{"params": [p for p in policy.parameters() if p.requires_grad],
                   "lr": trainer.learning_rate, "weight_decay": trainer.weight_decay}]
        head = None
        if self.critic_mode == "shared":
            head = new_value_head(policy.config.hidden_size)
            saved = read_critic_folder(model_path, "shared")
            if saved is not None:
                load_value_head(head, saved)
            groups.append({"params": list(head.parameters()), "lr": algorithm.critic.learning_rate,
                           "weight_decay": algorithm.critic.weight_decay})
        optimizer = torch.optim.AdamW(groups, lr=trainer.learning_rate, weight_decay=trainer.weight_decay)
        schedule = lr_lambda(trainer)
        wrapped = LogprobModel(policy, head)
        self._watch = FiniteWatch(wrapped, optimizer)
        # A callable: DeepSpeed builds the scheduler on the optimizer it really steps, steps it
        # at each accumulation boundary (= optimizer step) and keeps it in its checkpoints.
        self.engine, self.optimizer, _, self.lr_scheduler = deepspeed.initialize(
            model=wrapped, optimizer=optimizer, config=ds_config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
        )
        self._watch.engine = self.engine
        if self.lora:
            self._adapter_only_checkpoints()
        self._critic_watch: FiniteWatch | None = None
        self.nonfinite_streak = 0  # optimizer steps skipped in a row (NonFiniteTrainingError at the max)
        self.nonfinite_skips = 0  # optimizer steps skipped since the trainer started
        self.critic_engine: Any = None  # DeepSpeed's engine over the separate critic (untyped)
        self.critic_steps = 0
        if self.critic_mode == "separate":
            self._build_separate_critic(model_path, ds_config)
        self.ref: PreTrainedModel | None = None
        if algorithm.kl_coef > 0:
            dtype = torch.bfloat16 if resolve_bf16(trainer.bf16) else torch.float32
            self.ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, local_files_only=True)
            self.ref.eval().requires_grad_(False).to(self.engine.device)
        self.optimizer_steps = 0

    def _build_separate_critic(self, model_path: str | Path, ds_config: dict[str, Any]) -> None:
        """The value model: the base transformer (from the export's ``critic/`` when resuming,
        else the policy's weights) plus a value head, in its own engine with its own AdamW."""
        import deepspeed

        cc = self.algo.critic
        saved = read_critic_folder(model_path, "separate")
        trunk = AutoModel.from_pretrained(saved or model_path, dtype=torch.float32, local_files_only=True)
        trunk.config.use_cache = False
        if self.cfg.gradient_checkpointing:
            trunk.gradient_checkpointing_enable()
        head = new_value_head(trunk.config.hidden_size)
        if saved is not None:
            load_value_head(head, saved)
        critic = ValueModel(trunk, head)
        optimizer = torch.optim.AdamW(critic.parameters(), lr=cc.learning_rate, weight_decay=cc.weight_decay)
        self._critic_watch = FiniteWatch(critic, optimizer)
        self.critic_engine, self.critic_optimizer, _, _ = deepspeed.initialize(
            model=critic, optimizer=optimizer, config={**ds_config, "gradient_clipping": cc.grad_clip},
        )
        self._critic_watch.engine = self.critic_engine

    @property
    def has_critic(self) -> bool:
        return self.critic_mode != "none"

    def _adapter_only_checkpoints(self) -> None:
        """DeepSpeed's ``exclude_frozen_parameters`` drops frozen parameters by their first name
        only, so a tied alias (lm_head.weight = embed_tokens.weight) stays in LoRA checkpoints;
        drop every name of a frozen tensor (``agentgym.patches.deepspeed.exclude_frozen_aliases``)."""
        exclude_frozen_aliases(self.engine)

    # -- weights ---------------------------------------------------------------------------
    @property
    def module(self) -> Policy:
        """The policy (a peft model with LoRA) inside the engine."""
        return self.engine.module.policy

    def _lora_base(self) -> PreTrainedModel:
        """With LoRA: the transformers model under peft's wrapper, adapter layers in place."""
        from peft import PeftModel

        module = self.module
        if not isinstance(module, PeftModel):
            raise RuntimeError("the policy has no LoRA adapter (trainer.lora is null)")
        return cast(PreTrainedModel, module.get_base_model())  # peft types it as a torch Module

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

        base = self._lora_base()
        # peft's LoRA layers (lora.Linear, Embedding, ...): torch modules with get_delta_weight;
        # LoraLayer, the mixin they share, declares neither
        adapted: dict[str, Any] = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
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

    def save_adapter(self, out_dir: str | Path) -> Path:
        """Write the LoRA adapter alone in peft's ``save_pretrained`` format (adapter_config.json,
        adapter_model.safetensors), the form vLLM's ``/v1/load_lora_adapter`` reads. Under ZeRO-3
        every rank must call this (the adapter weights are gathered); only rank 0 writes."""
        if not self.lora:
            raise RuntimeError("save_adapter needs LoRA training (trainer.lora)")
        out = Path(out_dir)
        with disk_errors("the LoRA adapter", out, _NO_SPACE_FIX):
            params = [(n, p) for n, p in self.module.named_parameters() if ".lora_" in n]
            state = None
            if self.zero3:
                with self._gathered([p for _, p in params]):
                    state = {n: p.detach().clone() for n, p in params}
            if self.rank == 0:
                out.mkdir(parents=True, exist_ok=True)
                self.module.save_pretrained(str(out), state_dict=state, safe_serialization=True)
        return out

    def save_hf(self, out_dir: str | Path, tokenizer: PreTrainedTokenizerBase | None) -> Path:
        """Export the policy as an HF folder (merged weights with LoRA). Under ZeRO-3 every rank
        must call this (the weights are gathered); only rank 0 writes. ``tokenizer`` None: the
        caller writes it. A full disk raises ``OSError(ENOSPC)`` naming ``out_dir``."""
        with disk_errors("the policy's HF export", out_dir, _NO_SPACE_FIX):
            return self._save_hf(Path(out_dir), tokenizer)

    def _save_hf(self, out: Path, tokenizer: PreTrainedTokenizerBase | None) -> Path:
        if not self.lora and not self.zero3:
            if self.rank == 0:
                out.mkdir(parents=True, exist_ok=True)
                self.module.save_pretrained(str(out), safe_serialization=True)
        else:
            state = dict(self.named_weights())
            if self.rank == 0:
                out.mkdir(parents=True, exist_ok=True)
                base = self._lora_base() if self.lora else self.module
                base.save_pretrained(str(out), state_dict=state, safe_serialization=True)
        if tokenizer is not None and self.rank == 0:
            tokenizer.save_pretrained(out)
        if self.has_critic:
            self._save_critic(out / CRITIC_DIR)
        return out

    def _full_state(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Full-tensor copies of ``module``'s parameters and buffers (gathered under ZeRO-3: a
        collective, every rank must call)."""
        with self._gathered(list(module.parameters())):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}

    def _save_critic(self, folder: Path) -> None:
        """The critic as ``critic/``: ``critic.json``, ``value_head.safetensors`` and, for a
        separate critic, its transformer as an HF folder (``AutoModel.from_pretrained`` loads it).
        A trainer built on the export (``model_path``) starts from this critic."""
        from safetensors.torch import save_file

        if self.critic_mode == "separate":
            critic = self.critic_engine.module
            trunk_state = self._full_state(critic.trunk)
            head_state = self._full_state(critic.value_head)
        else:
            critic, trunk_state = None, None
            head_state = self._full_state(self.engine.module.value_head)
        if self.rank != 0:
            return
        folder.mkdir(parents=True, exist_ok=True)
        if critic is not None:
            critic.trunk.save_pretrained(folder, state_dict=trunk_state, safe_serialization=True)
        save_file({k: v.contiguous() for k, v in head_state.items()}, str(folder / VALUE_HEAD_FILE))
        (folder / "critic.json").write_text(json.dumps({
            "model": self.critic_mode, "value_head": VALUE_HEAD_FILE,
            "note": "values V[:, t] = value_head(hidden[:, t-1]) of the transformer's last hidden states",
        }, indent=2))

    def save_checkpoint(self, ckpt_dir: str | Path, client_state: dict[str, Any] | None = None) -> Path:
        """Everything an exact resume needs: model (LoRA: adapters only), optimizer, learning-rate
        schedule, DeepSpeed's step counters (DeepSpeed's own format under ``{dir}/ds``), this
        trainer's step count and every rank's python/numpy/torch RNG states. All ranks must call
        it; with several hosts ``ckpt_dir`` must be on a shared filesystem. ``client_state``
        must hold plain values (numbers, strings, lists, dicts, tensors). A full disk raises
        ``OSError(ENOSPC)`` naming ``ckpt_dir`` (torch.save's own error does not say so)."""
        with disk_errors("the trainer checkpoint (DeepSpeed state)", ckpt_dir, _NO_SPACE_FIX):
            return self._save_checkpoint(Path(ckpt_dir), client_state)

    def _save_checkpoint(self, ckpt: Path, client_state: dict[str, Any] | None) -> Path:
        state = dict(client_state or {})
        state[_RESERVED] = {"optimizer_steps": self.optimizer_steps, "world_size": self.world_size,
                            "keys": sorted(client_state or {})}
        state[_RESERVED]["critic_steps"] = self.critic_steps
        self.engine.save_checkpoint(str(ckpt), tag=CHECKPOINT_TAG, client_state=state,
                                    exclude_frozen_parameters=self.lora)
        if self.critic_engine is not None:  # its own engine: model, AdamW moments, step counters
            self.critic_engine.save_checkpoint(str(ckpt / CRITIC_DIR), tag=CHECKPOINT_TAG)
        torch.save(rng_state(), ckpt / CHECKPOINT_TAG / f"rng_rank{self.rank}.pt")
        if self.rank == 0:  # what a resume must build to load it (zero_stage.checkpoint_stages)
            (ckpt / CHECKPOINT_TAG / STATE_FILE).write_text(json.dumps({"zero_stage": self.cfg.zero_stage}))
        torch.distributed.barrier()
        return ckpt

    def load_checkpoint(self, ckpt_dir: str | Path) -> dict[str, Any]:
        """Restore a ``save_checkpoint`` folder (made with the same base model, config and world
        size) into this trainer; returns the caller's ``client_state``."""
        ckpt = Path(ckpt_dir)
        if not (ckpt / CHECKPOINT_TAG).is_dir():
            raise FileNotFoundError(f"{ckpt} holds no trainer checkpoint (no {CHECKPOINT_TAG}/ folder)")
        written = checkpoint_stages(ckpt / CHECKPOINT_TAG)
        if written and self.cfg.zero_stage not in written:
            stage = max(written)
            raise ValueError(f"checkpoint {ckpt} was written at DeepSpeed ZeRO-{stage}; this trainer runs "
                             f"ZeRO-{self.cfg.zero_stage}, whose optimizer state DeepSpeed lays out otherwise: "
                             f"resume with trainer.zero_stage: {stage} (or auto, which follows the checkpoint)")
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
        self.critic_steps = int(ours.get("critic_steps", 0))
        if self.critic_engine is not None:
            if not (ckpt / CRITIC_DIR / CHECKPOINT_TAG).is_dir():
                raise FileNotFoundError(f"{ckpt} holds no critic checkpoint ({CRITIC_DIR}/{CHECKPOINT_TAG}/); "
                                        "it was saved without algorithm.critic.model=separate")
            cpath, _ = self.critic_engine.load_checkpoint(
                str(ckpt / CRITIC_DIR), tag=CHECKPOINT_TAG, load_optimizer_states=True,
                load_lr_scheduler_states=True)
            if cpath is None:
                raise RuntimeError(f"DeepSpeed could not load the critic checkpoint in {ckpt / CRITIC_DIR}")
        rng_file = ckpt / CHECKPOINT_TAG / f"rng_rank{self.rank}.pt"
        set_rng_state(torch.load(rng_file, weights_only=False))
        # DeepSpeed returns client_state with its own keys mixed in: keep only the caller's.
        keys = ours.get("keys", list(state))
        state = {k: state[k] for k in keys if k in state}
        return state

    def close(self) -> None:
        """Nothing to release in-process (the interface matches ``RayTrainerGroup.close``)."""

    # -- forward passes without an update ---------------------------------------------------
    COMPUTABLE = ("logprobs", "values", "ref_logprobs")

    @torch.no_grad()
    def compute(self, batch: TrainBatch, what: tuple[str, ...] | list[str]) -> dict[str, torch.Tensor]:
        """Forward passes over ``batch`` in micro-batches, dropout off, no gradient: any of
        ``logprobs`` (the current policy's, as the PPO ratio's old log-probs), ``values`` (the
        critic's V, (B, T)) and ``ref_logprobs`` (the frozen reference's). Each (B, T) float32 on
        the CPU; log-probs are 0 at masked tokens, and renormalised over the candidates at the
        constrained replies of a batch with ``choices`` (``rollout.action_logprob``). Every rank computes the whole batch (ZeRO-3's
        gathers are collectives; the results are identical on every rank)."""
        unknown = set(what) - set(self.COMPUTABLE)
        if unknown:
            raise ValueError(f"compute: unknown quantities {sorted(unknown)}; choose from {list(self.COMPUTABLE)}")
        if "values" in what and not self.has_critic:
            raise ValueError("compute('values') needs a critic: set algorithm.estimator=gae and "
                             "algorithm.critic.model")
        if "ref_logprobs" in what and self.ref is None:
            raise ValueError("compute('ref_logprobs') needs the reference model: set algorithm.kl_coef > 0")
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in what}
        was_training = self.engine.training
        self.engine.eval()
        if self.critic_engine is not None:
            self.critic_engine.eval()
        try:
            for idx in torch.split(torch.arange(len(batch)), self.cfg.micro_batch_size):
                mb = batch.select(idx).to(self.engine.device)
                shared = "values" in what and self.critic_mode == "shared"
                if "logprobs" in what or shared:
                    out = self.engine(mb.input_ids, mb.attention_mask, mb.loss_mask, self.temperature, False, shared,
                                      choices=mb.choices, action_temperature=self.action_temperature)
                    if "logprobs" in what:
                        parts["logprobs"].append(out[0].float().cpu())
                    if shared:
                        parts["values"].append(out[2].float().cpu())
                if "values" in what and self.critic_mode == "separate":
                    parts["values"].append(self.critic_engine(mb.input_ids, mb.attention_mask).float().cpu())
                if "ref_logprobs" in what and self.ref is not None:  # checked above: it is there
                    parts["ref_logprobs"].append(token_logprobs(self.ref, mb, self.temperature, False, self.action_temperature)[0].float().cpu())
        finally:
            self.engine.train(was_training)
            if self.critic_engine is not None:
                self.critic_engine.train(was_training)
        return {k: torch.cat(v) for k, v in parts.items()}

    def advance_lr_schedule(self, steps: int) -> None:
        """Step the learning-rate schedule ``steps`` times without training (see ``Trainer``)."""
        with warnings.catch_warnings():  # no optimizer step before it: that is the point here
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            for _ in range(int(steps)):
                self.lr_scheduler.step()

    @torch.no_grad()
    def sft_metrics(self, batch: TrainBatch) -> dict[str, float]:
        """Cross-entropy (``sft_loss``, token mean) and ``token_accuracy`` of ``batch``'s loss-mask
        tokens under the current policy, dropout off, no gradient: the held-out measure of the
        SFT stage."""
        was_training = self.engine.training
        self.engine.eval()
        nll = correct = tokens = 0.0
        try:
            for idx in torch.split(torch.arange(len(batch)), self.cfg.micro_batch_size):
                mb = batch.select(idx).trimmed().to(self.engine.device)
                lp, _, right = self.engine(mb.input_ids, mb.attention_mask, mb.loss_mask, 1.0, False,
                                           False, True)
                m = mb.loss_mask.bool()
                nll -= float(lp[m].double().sum())
                correct += float(right[m].double().sum())
                tokens += float(m.sum())
        finally:
            self.engine.train(was_training)
        n = max(tokens, 1.0)
        return {"sft_loss": nll / n, "token_accuracy": correct / n, "tokens": tokens}

    # -- update ----------------------------------------------------------------------------
    def _micro_loss(self, mb: TrainBatch, norm_length: int) -> tuple[torch.Tensor, dict[str, float]]:
        shared = self.critic_mode == "shared"
        out = self.engine(mb.input_ids, mb.attention_mask, mb.loss_mask, self.temperature, True, shared,
                          entropy_grad=bool(self.algo.entropy_coef), choices=mb.choices,
                          action_temperature=self.action_temperature)
        lp, ent = out[0], out[1]
        loss, m = A.policy_loss(
            lp, mb.old_logprobs, mb.advantages, mb.loss_mask,
            clip_low=self.algo.clip_low, clip_high=self.algo.clip_high,
            dual_clip=self.algo.dual_clip, loss_agg=self.algo.loss_agg, norm_length=norm_length,
        )
        metrics = dict(m)  # policy_loss (the clipped objective), clipfrac, approx_kl, ratio_mean ...
        ent_term = A.aggregate_loss(ent, mb.loss_mask, self.algo.loss_agg, norm_length=norm_length)
        metrics["entropy"] = float(ent_term.detach())
        if self.algo.entropy_coef:
            loss = loss - self.algo.entropy_coef * ent_term
        if shared:
            vloss, vm = self._value_loss(out[2], mb, norm_length)
            loss = loss + self.algo.critic.value_loss_coef * vloss
            metrics.update(vm)
        if self.ref is not None and not self.algo.kl_in_reward:  # kl_in_reward: it is in the advantages
            with torch.no_grad():
                ref_lp, _ = token_logprobs(self.ref, mb, self.temperature, False, self.action_temperature)
            kl = A.kl_penalty(lp, ref_lp, self.algo.kl_estimator)
            kl_term = A.aggregate_loss(kl, mb.loss_mask, self.algo.loss_agg, norm_length=norm_length)
            loss = loss + self.algo.kl_coef * kl_term
            metrics["kl"] = float(kl_term.detach())
        return loss, metrics

    def _sft_micro_loss(self, mb: TrainBatch, norm_length: int) -> tuple[torch.Tensor, dict[str, float]]:
        """objective=sft: cross-entropy of the loss-mask tokens at temperature 1, plus their
        token accuracy (argmax == demonstrated token)."""
        lp, _, correct = self.engine(mb.input_ids, mb.attention_mask, mb.loss_mask, 1.0, False,
                                     False, True)
        loss, m = A.sft_loss(lp, mb.loss_mask, self.algo.loss_agg, norm_length=norm_length)
        m["token_accuracy"] = float(A.masked_mean(correct, mb.loss_mask))
        return loss, m

    def _value_loss(self, values: torch.Tensor, mb: TrainBatch,
                    norm_length: int) -> tuple[torch.Tensor, dict[str, float]]:
        cc = self.algo.critic
        if mb.old_values is None or mb.returns is None:  # _prepare fills both for a critic
            raise ValueError("the value loss needs the batch's old_values and returns (a critic's batch)")
        vloss, vm = A.value_loss(values, mb.old_values, mb.returns, mb.loss_mask, clip=cc.value_clip,
                                 loss_agg=self.algo.loss_agg, norm_length=norm_length)
        return vloss, {"vf_loss": vm["vf_loss"], "vf_clipfrac": vm["vf_clipfrac"], "vpred_mean": vm["vpred_mean"]}

    def _critic_micro_loss(self, mb: TrainBatch, norm_length: int) -> tuple[torch.Tensor, dict[str, float]]:
        """critic.model=separate: the critic engine's loss on one micro-batch."""
        values = self.critic_engine(mb.input_ids, mb.attention_mask)
        vloss, vm = self._value_loss(values, mb, norm_length)
        return self.algo.critic.value_loss_coef * vloss, vm

    def _prepare(self, batch: TrainBatch) -> tuple[TrainBatch, dict[str, float]]:
        """What must be computed before the first optimizer step: recomputed old log-probs
        (``recompute_old_logprobs``) and, with a critic, the old values if the batch lacks them."""
        metrics: dict[str, float] = {}
        what = []
        if self.algo.recompute_old_logprobs:
            what.append("logprobs")
        if self.has_critic:
            if batch.returns is None:
                raise ValueError("the critic needs batch.returns (its regression targets, from the advantages step)")
            if batch.old_values is None:
                what.append("values")
        if not what:
            return batch, metrics
        got = self.compute(batch, what)
        if "logprobs" in got:
            diff = (got["logprobs"] - batch.old_logprobs).abs()
            metrics["old_logprob_abs_diff"] = float(A.masked_mean(diff, batch.loss_mask))
            batch = replace(batch, old_logprobs=got["logprobs"])
        if "values" in got:
            batch = replace(batch, old_values=got["values"])
        return batch, metrics

    def _weight(self, mb: TrainBatch, mini: TrainBatch) -> float:
        """Share of the mini-batch loss one micro-batch carries, so that the sum of weighted
        micro-batch losses equals the mini-batch loss exactly for every aggregation mode."""
        mode = self.algo.loss_agg
        if mode == "token-mean":
            return float(mb.loss_mask.sum() / mini.loss_mask.sum().clamp(min=1))
        if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):  # rows without policy tokens are left out
            def rows(b: TrainBatch) -> float:
                return float((b.loss_mask.sum(-1) > 0).sum())

            return rows(mb) / max(rows(mini), 1.0)
        return 1.0  # seq-mean-token-sum-norm is a sum over rows with a fixed divisor

    def train_from_store(self, store: dict[str, Any], stage: int, iteration: int,
                         seed: int = 0) -> dict[str, float]:
        """Train on the iteration's committed ``train_batch`` table of the trajectory store
        (``TrajectoryStore.spec()``): the pipeline's one batch path, at every world size."""
        t0 = time.perf_counter()
        segments, _ = TrajectoryStore(**store).read_train_batch(stage, iteration).segments()
        batch = segments.padded(self.pad_id)  # a row per context segment: what the policy saw
        read_s = time.perf_counter() - t0  # store read + padding: the rest is forward/backward/step
        return {**self.train_on_batch(batch, seed=seed), "time/train_store_read_s": read_s}

    def train_on_batch(self, batch: TrainBatch, seed: int = 0, objective: str = "ppo",
                       epochs: int | None = None, mini_batches: int | None = None) -> dict[str, float]:
        """``ppo_epochs`` passes x ``mini_batches`` optimizer steps over ``batch``.

        ``objective="sft"`` trains the cross-entropy of the loss-mask tokens instead (supervised
        fine-tuning on demonstrations: no advantages, no critic, no KL), reporting ``sft_loss``
        and ``token_accuracy``; ``epochs`` / ``mini_batches`` override the algorithm's
        ``ppo_epochs`` / ``mini_batches`` (the SFT stage makes one step per call).

        With N ranks every rank gets the same ``batch`` and ``seed`` and trains on its slice
        (see the module docstring). Metrics: per-micro-batch means (``policy_loss``, ``entropy``,
        ...) over all ranks, ``loss`` = the exact mini-batch objective (weighted sum over its
        micro-batches and ranks) averaged over optimizer steps, ``lr`` of the last step. With a
        critic also ``vf_loss``, ``vf_clipfrac``, ``vpred_mean`` (and for a separate one
        ``critic_grad_norm``); with ``recompute_old_logprobs`` ``old_logprob_abs_diff`` (mean
        |recomputed - engine| old log-prob over policy tokens). Recomputed old log-probs and
        missing old values are computed before the first step (``compute``).

        A step whose loss or gradient is not finite is skipped (nothing applied, see
        ``FiniteWatch``) and counted in ``nonfinite_skips``; ``optimizer_steps`` counts applied
        steps and the metrics above are theirs. ``trainer.max_nonfinite_skips`` skips in a row
        (across calls) raise ``NonFiniteTrainingError``.
        """
        if objective not in ("ppo", "sft"):
            raise ValueError(f"train_on_batch: objective must be 'ppo' or 'sft', got {objective!r}")
        sft = objective == "sft"
        batch, pre = (batch, {}) if sft else self._prepare(batch)
        self.engine.train()
        critic = None if sft else self.critic_engine
        if critic is not None:
            critic.train()
        gen = torch.Generator().manual_seed(seed)
        history: dict[str, list[float]] = {}
        step_losses: list[float] = []
        lr = float("nan")
        steps = skipped = 0
        n, rank = self.world_size, self.rank
        mbs = self.cfg.micro_batch_size
        for _ in range(epochs or self.algo.ppo_epochs):
            order = torch.randperm(len(batch), generator=gen)
            for chunk in torch.tensor_split(order, mini_batches or self.algo.mini_batches):
                if len(chunk) == 0:
                    continue
                mini = batch.select(chunk)
                # rows of similar length share a micro-batch: less padding to compute (the
                # weights keep the accumulated objective exact whatever the grouping). Sorted
                # before the mini-batch is shared out, so N ranks run the one process's
                # micro-batches and their per-micro-batch metric means agree with it too.
                by_length = torch.argsort(mini.attention_mask.sum(-1), stable=True)
                shares = torch.tensor_split(by_length, n)
                micro = list(torch.split(shares[rank], mbs)) if len(shares[rank]) else []
                passes = max(1, max(math.ceil(len(sh) / mbs) for sh in shares))
                step_loss, finite_loss = 0.0, True
                step_history: dict[str, list[float]] = {}
                for k in range(passes):
                    self.engine.set_gradient_accumulation_boundary(k == passes - 1)
                    if k < len(micro):
                        mb = mini.select(micro[k])
                        w = self._weight(mb, mini)
                    else:  # this rank's slice ran out: a zero-weight pass keeps collectives aligned
                        mb, w = mini.select([0]), 0.0
                    mb = mb.trimmed().to(self.engine.device)
                    micro_loss = self._sft_micro_loss if sft else self._micro_loss
                    loss, m = micro_loss(mb, norm_length=batch.input_ids.shape[1])
                    self.engine.backward(loss * (w * n), scale_wrt_gas=False)
                    finite_loss &= math.isfinite(float(loss.detach()))
                    if critic is not None:  # same micro-batch, same weight, its own engine
                        critic.set_gradient_accumulation_boundary(k == passes - 1)
                        closs, cm = self._critic_micro_loss(mb, norm_length=batch.input_ids.shape[1])
                        critic.backward(closs * (w * n), scale_wrt_gas=False)
                        finite_loss &= math.isfinite(float(closs.detach()))
                        m = {**m, **cm}
                    if k < len(micro):
                        step_loss += w * float(loss.detach())
                        for key, v in m.items():
                            step_history.setdefault(key, []).append(v)
                fault = self._step_fault(finite_loss, critic)
                if fault is not None:  # nothing is applied; the step's metrics are dropped
                    self._skip_step(critic, fault)
                    skipped += 1
                    continue
                self.nonfinite_streak = 0
                for key, values in step_history.items():
                    history.setdefault(key, []).extend(values)
                lr = float(self.optimizer.param_groups[0]["lr"])
                unreported = _unreported_grad_norm(self.engine)
                self.engine.step()
                step_losses.append(step_loss)
                gn = self.engine.get_global_grad_norm() if unreported is None else unreported
                if gn is not None:
                    history.setdefault("grad_norm", []).append(float(gn))
                if critic is not None:
                    unreported = _unreported_grad_norm(critic)
                    critic.step()
                    self.critic_steps += 1
                    cgn = critic.get_global_grad_norm() if unreported is None else unreported
                    if cgn is not None:
                        history.setdefault("critic_grad_norm", []).append(float(cgn))
                steps += 1
        if n > 1:  # exact objective: sum over ranks; micro-batch metrics: pooled over ranks
            t = torch.tensor(step_losses, dtype=torch.float64)
            torch.distributed.all_reduce(t)
            step_losses = t.tolist()
            pooled: list[dict[str, list[float]]] = [None] * n  # type: ignore[list-item]
            local = {k: v for k, v in history.items() if not k.endswith("grad_norm")}
            torch.distributed.all_gather_object(pooled, local)
            merged: dict[str, list[float]] = {}
            for h in pooled:
                for key, values in h.items():
                    merged.setdefault(key, []).extend(values)
            for key in ("grad_norm", "critic_grad_norm"):  # already global (all-reduced) norms
                if key in history:
                    merged[key] = history[key]
            history = merged
        self.optimizer_steps += steps
        out = {k: float(np.nanmean(v)) if not all(np.isnan(v)) else float("nan") for k, v in history.items()}
        out["loss"] = float(np.mean(step_losses)) if step_losses else float("nan")
        out["lr"] = lr
        out["optimizer_steps"] = float(steps)
        out["nonfinite_skips"] = float(skipped)
        out.update(pre)
        return out

    def _step_fault(self, finite_loss: bool, critic: Any) -> str | None:
        """Why the optimizer step about to be taken must be skipped, or None: a non-finite loss
        or gradient (policy or critic) on any rank. With N ranks this is a collective, so every
        rank skips or steps alike (a partial step would leave the ranks' weights different)."""
        finite_grad = self._watch.take()
        if self._critic_watch is not None:  # taken even when idle: it must not carry flags over
            finite_grad = self._critic_watch.take() and finite_grad
        bad = torch.tensor([float(not finite_loss), float(not finite_grad)])
        if self.world_size > 1:
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        if bad[0]:
            return "a non-finite loss"
        if bad[1]:
            return "a non-finite gradient"
        return None

    def _skip_step(self, critic: Any, fault: str) -> None:
        """Take the step with nothing applied (gradients cleared, weights, AdamW state and LR
        schedule as they were); raise ``NonFiniteTrainingError`` at ``max_nonfinite_skips`` in
        a row."""
        with self._watch.skipping():
            self.engine.step()
        if critic is not None and self._critic_watch is not None:
            with self._critic_watch.skipping():
                critic.step()
        self.nonfinite_streak += 1
        self.nonfinite_skips += 1
        limit = self.cfg.max_nonfinite_skips
        log.warning("optimizer step skipped: %s (NaN/Inf; %d in a row, training stops at %d)",
                    fault, self.nonfinite_streak, limit)
        if self.nonfinite_streak >= limit:
            raise NonFiniteTrainingError(
                f"{self.nonfinite_streak} optimizer steps in a row had {fault} (NaN/Inf) and were "
                f"skipped (trainer.max_nonfinite_skips={limit}); weights and optimizer state are "
                "those of the last applied step. Look for NaN/Inf in the batch (advantages, "
                "returns, old log-probs) or lower trainer.learning_rate; raise "
                "trainer.max_nonfinite_skips to tolerate more skips in a row.")
