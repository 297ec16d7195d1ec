"""Inference engines: ``hf`` (transformers, CPU default) and, later, ``vllm``."""

from agentgym.engines.base import InferenceEngine, Sample, SamplingParams

__all__ = ["InferenceEngine", "Sample", "SamplingParams"]
