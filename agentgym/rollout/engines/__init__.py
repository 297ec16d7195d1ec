"""Inference engines: ``hf`` (transformers, CPU default), ``vllm`` (in-process) and
``vllm_server`` (remote ``vllm serve`` endpoints over HTTP)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from agentgym.rollout.engines.base import InferenceEngine, Sample, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agentgym.config import PipelineConfig


def create_engine(kind: str, model_path: str | Path, dtype: str = "bfloat16", device: str = "auto",
                  **kwargs) -> tuple[InferenceEngine, PreTrainedTokenizerBase]:
    """Build the rollout engine ``kind`` over a local HF folder; returns (engine, tokenizer).
    ``dtype`` "auto" is bfloat16 where the hardware computes it natively, else float32;
    ``device`` (hf only) "auto" is the first CUDA GPU where there is one, else the CPU."""
    from agentgym.models.hardware import resolve_device, resolve_dtype

    dtype = resolve_dtype(dtype)
    if kind == "hf":
        from agentgym.rollout.engines.hf import HFEngine
        from agentgym.models.folders import load_model

        model, tokenizer = load_model(model_path, dtype)
        # in place (a module's .to moves it); transformers types .to as its dtype-checking wrapper
        model.to(resolve_device(device))  # type: ignore[arg-type]
        return HFEngine(model, tokenizer, **kwargs), tokenizer
    if kind == "vllm":
        from agentgym.rollout.engines.vllm import VLLMEngine  # noqa: PLC0415 - optional dependency

        engine = VLLMEngine(model_path, dtype=dtype, **kwargs)
        return engine, engine.tokenizer
    if kind == "vllm_server":
        from agentgym.rollout.engines.vllm_server import VLLMServerEngine

        server = VLLMServerEngine(model_path, **kwargs)
        return server, server.tokenizer
    raise ValueError(f"unknown engine {kind!r}; use 'hf', 'vllm' or 'vllm_server'")


def engine_for(cfg: PipelineConfig, model_path: str | Path) -> tuple[InferenceEngine, PreTrainedTokenizerBase]:
    """The rollout engine ``cfg.rollout`` asks for, over the HF folder ``model_path``.

    vllm_server: the servers serve the base model (``model.name_or_path``), so ``model_path``
    must be that folder; a checkpoint (a resume, an evaluation of saved weights) cannot be
    served without restarting the servers on it, which this engine does not do."""
    r = cfg.rollout
    if r.engine != "vllm_server":
        return create_engine(r.engine, model_path, cfg.model.dtype, device=r.device)
    from agentgym.models.folders import resolve_model

    base = Path(resolve_model(cfg.model.name_or_path, cfg.model.cache_dir)).resolve()
    if Path(model_path).resolve() != base:
        raise ValueError(
            f"rollout.engine=vllm_server serves the base model {base} plus the run's live LoRA adapter, "
            f"not the saved weights {model_path} (a resumed run or an evaluation of a checkpoint); start "
            "the run afresh with a new run_id, or use rollout.engine: hf or vllm for it")
    return create_engine("vllm_server", model_path, cfg.model.dtype, servers=list(r.servers),
                         served_model=r.served_model, timeout_s=r.server_timeout_s,
                         retries=r.server_retries, adapter_dir=r.adapter_dir)


__all__ = ["InferenceEngine", "Sample", "SamplingParams", "create_engine", "engine_for"]
