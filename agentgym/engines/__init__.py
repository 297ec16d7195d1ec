"""Inference engines: ``hf`` (transformers, CPU default) and ``vllm``."""

from __future__ import annotations

from pathlib import Path

from agentgym.engines.base import InferenceEngine, Sample, SamplingParams


def create_engine(kind: str, model_path: str | Path, dtype: str = "bfloat16", **kwargs) -> tuple[InferenceEngine, object]:
    """Build the rollout engine ``kind`` over a local HF folder; returns (engine, tokenizer).
    ``dtype`` "auto" is bfloat16 where the hardware computes it natively, else float32."""
    from agentgym.hardware import resolve_dtype

    dtype = resolve_dtype(dtype)
    if kind == "hf":
        from agentgym.engines.hf import HFEngine
        from agentgym.models import load_model

        model, tokenizer = load_model(model_path, dtype)
        return HFEngine(model, tokenizer, **kwargs), tokenizer
    if kind == "vllm":
        from agentgym.engines.vllm import VLLMEngine  # noqa: PLC0415 - optional dependency

        engine = VLLMEngine(model_path, dtype=dtype, **kwargs)
        return engine, engine.tokenizer
    raise ValueError(f"unknown engine {kind!r}; use 'hf' or 'vllm'")


__all__ = ["InferenceEngine", "Sample", "SamplingParams", "create_engine"]
