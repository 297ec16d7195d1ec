"""The ``vllm_server`` rollout engine: generation through one or more remote ``vllm serve``.

Same contract as the in-process engines (``engines/base.py``), over HTTP, and no ``import
vllm`` (it runs in the main env):

* token-in/token-out: each prompt's ids go to ``POST /v1/completions`` as ``prompt`` (a list of
  ids) with ``logprobs: 0`` and ``return_tokens_as_token_ids: true``; each sampled token comes
  back as ``token_id:N`` with its log-prob, so nothing is re-encoded;
* the request fields (per-row seed, from ``row_seeds`` where given; greedy, stop ids and
  strings, EOS handling off) and the leading-whitespace stop-string rule are the in-process
  engine's, from ``vllm_rules``;
* the rows of a ``generate`` call are sent concurrently (one request each, the server batches
  them), each to the live server with the fewest requests in flight
  (``env_adapters.http_pool.ServerPool``: least loaded, health checks on ``GET /health``);
* a request that times out, cannot connect or gets a 5xx is retried on another server (up to
  ``retries`` more tries); when they are spent the call raises ``InfraError`` naming the server
  and the error, never an empty reply. A 4xx (a bad request) raises ``RuntimeError`` at once;
* weights: by LoRA adapter (``update_adapter``). The trainer writes the adapter (peft's
  ``save_pretrained`` format) to a new folder under ``adapter_dir``, which every server must be
  able to read at the same path; the engine calls ``POST /v1/load_lora_adapter`` on every server,
  checks that ``GET /v1/models`` lists it, unloads the previous one and sends later requests
  with ``model=<adapter name>``. A server that missed the load (down at the time, or restarted
  since, which drops runtime adapters) gets it before its next request. Full fine-tuning has no
  update path on vLLM 0.32's CPU backend (``update_weights`` raises; see docs/scale-out.md).

Log-probs are ``log_softmax(logits / T)`` of the sampled tokens when the server runs with
``--logprobs-mode processed_logprobs`` and ``top_p == 1``; greedy at T != 1 and ``top_p < 1``
also need the project's sampler patch inside the server, which
``python -m agentgym.rollout.engines.vllm_server_launch`` applies (``vllm_server_launch.serve_args``
lists every option the engine relies on).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from agentgym.rollout.engines.base import Sample, SamplingParams, check_prompts
from agentgym.rollout.engines.vllm_rules import Piece, generate_with_stop_rule
from env_adapters.base import InfraError
from env_adapters.http_pool import ServerPool

log = logging.getLogger(__name__)

_TOKEN_PREFIX = "token_id:"


class _Retryable(Exception):
    """A failure another try (maybe on another server) may not have: transport, 5xx, 404."""

    def __init__(self, url: str, why: str, transport: bool = False, lost_adapter: bool = False):
        super().__init__(f"{url}: {why}")
        self.url, self.why, self.transport, self.lost_adapter = url, why, transport, lost_adapter


def parse_choice(choice: dict[str, Any]) -> Piece:
    """A completions choice (``logprobs: 0``, ``return_tokens_as_token_ids: true``) as a Piece."""
    lp = choice.get("logprobs") or {}
    tokens, values = lp.get("tokens"), lp.get("token_logprobs")
    if tokens is None or values is None or len(tokens) != len(values):
        raise RuntimeError(f"vllm_server: a reply without per-token log-probs ({sorted(lp)}); does the "
                           "server accept logprobs and return_tokens_as_token_ids?")
    ids: list[int] = []
    for t in tokens:
        if not isinstance(t, str) or not t.startswith(_TOKEN_PREFIX):
            raise RuntimeError(f"vllm_server: token {t!r} is not 'token_id:N' (the server ignored "
                               "return_tokens_as_token_ids)")
        ids.append(int(t[len(_TOKEN_PREFIX):]))
    if any(v is None for v in values):
        raise RuntimeError("vllm_server: a sampled token without a log-prob")
    return Piece(ids, [float(v) for v in values], choice.get("finish_reason"), choice.get("stop_reason"))


class VLLMServerEngine:
    """Rollouts against ``vllm serve`` endpoints (``rollout.engine: vllm_server``).

    ``servers``: base URLs (``http://host:port``). ``served_model``: the model name the servers
    serve; None takes the one base model they list (it must be the same on all). ``adapter_dir``:
    a folder every server reads at the same path (None: a private temp folder, right for servers
    on this host only).
    """

    def __init__(self, model_path: str | os.PathLike, servers: list[str], *,
                 served_model: str | None = None, timeout_s: float = 120.0, retries: int = 2,
                 adapter_dir: str | os.PathLike | None = None, max_concurrency: int = 64,
                 health_interval_s: float = 5.0, connect_timeout_s: float = 5.0):
        from transformers import AutoTokenizer

        self.model_path = Path(os.path.expanduser(str(model_path))).resolve()
        self.pool = ServerPool(list(servers), health_interval_s=health_interval_s,
                               health_timeout_s=min(connect_timeout_s, 5.0))
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self.retries = int(retries)
        self.max_concurrency = int(max_concurrency)
        self._client = httpx.Client(timeout=self.timeout,
                                    limits=httpx.Limits(max_connections=self.max_concurrency))
        tokenizer = AutoTokenizer.from_pretrained(str(self.model_path), local_files_only=True)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None and tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        self.tokenizer = tokenizer
        self.generated_tokens = 0
        self.generate_seconds = 0.0  # wall time inside generate (the pipeline's timing metrics)
        self.prefilled_tokens = 0  # prompt tokens sent (the server's prefix cache is not visible here)
        self.weights_version = 0
        self.served_by: dict[str, int] = {s.url: 0 for s in self.pool.servers}  # answered completions
        self._own_adapter_dir = adapter_dir is None
        self.adapter_dir = Path(tempfile.mkdtemp(prefix="agentgym-adapters-")) if adapter_dir is None \
            else Path(os.path.expanduser(str(adapter_dir)))
        self._run_tag = uuid.uuid4().hex[:8]  # adapter names unique per engine: servers may be shared
        self.adapter: tuple[str, str] | None = None  # (name, path) of the current adapter
        self._loaded: dict[str, str | None] = {s.url: None for s in self.pool.servers}
        self._server_locks = {s.url: threading.Lock() for s in self.pool.servers}
        self._lock = threading.Lock()
        self.served_model = served_model or self._discover_model()
        self._closed = False

    # -- servers -----------------------------------------------------------------------------
    def _discover_model(self) -> str:
        """The one base model every reachable server lists under ``GET /v1/models``."""
        names: dict[str, str] = {}
        errors: list[str] = []
        for s in self.pool.servers:
            try:
                r = self._client.get(f"{s.url}/v1/models", timeout=httpx.Timeout(10.0))
                r.raise_for_status()
                bases = [m["id"] for m in r.json().get("data", []) if not m.get("parent")]
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                errors.append(f"{s.url}: {type(exc).__name__}: {exc}")
                self.pool.mark_down(s.url, f"GET /v1/models failed: {exc}")
                continue
            if len(bases) != 1:
                raise ValueError(f"vllm_server {s.url} serves {bases or 'no models'}; name the one to use "
                                 "with rollout.served_model")
            names[s.url] = bases[0]
        if not names:
            raise InfraError("vllm_server: no server answered GET /v1/models (" + "; ".join(errors) + ")")
        if len(set(names.values())) > 1:
            raise ValueError(f"rollout.servers serve different models {names}; every server must serve "
                             "model.name_or_path's weights under one name (vllm serve --served-model-name)")
        return next(iter(names.values()))

    def _request_model(self) -> str:
        return self.adapter[0] if self.adapter else self.served_model

    def _post(self, url: str, route: str, body: dict[str, Any]) -> httpx.Response:
        try:
            r = self._client.post(f"{url}{route}", json=body)
        except httpx.ConnectTimeout as exc:
            raise _Retryable(url, f"timed out connecting ({type(exc).__name__}) on {route}", transport=True) from exc
        except httpx.TimeoutException as exc:
            # slow, not known dead (a loaded server): retried, but the server stays in rotation
            raise _Retryable(url, f"timed out ({type(exc).__name__}) on {route}") from exc
        except httpx.TransportError as exc:
            raise _Retryable(url, f"{type(exc).__name__}: {exc} on {route}", transport=True) from exc
        if r.status_code >= 500:
            raise _Retryable(url, f"HTTP {r.status_code} on {route}: {r.text[:300]}")
        return r

    # -- generation --------------------------------------------------------------------------
    def _complete(self, prompt: list[int], fields: dict[str, Any]) -> Piece:
        """One completion, with retries over servers; ``InfraError`` when they are spent."""
        failed: list[str] = []
        for attempt in range(self.retries + 1):
            exclude = tuple(failed) if self.pool.live_count(tuple(failed)) else ()
            try:
                url = self.pool.acquire(exclude)
            except InfraError as exc:  # every server is down
                raise InfraError(f"vllm_server: {exc}") from exc
            try:
                self._ensure_adapter(url)
                body = dict(fields, model=self._request_model(), prompt=prompt,
                            return_tokens_as_token_ids=True, stream=False)
                r = self._post(url, "/v1/completions", body)
                if r.status_code == 404 and self.adapter is not None:
                    # the server lost the adapter (restarted): load it again, then retry
                    with self._lock:
                        self._loaded[url] = None
                    raise _Retryable(url, f"HTTP 404 (adapter {self.adapter[0]} not loaded): {r.text[:200]}",
                                     lost_adapter=True)
                if r.status_code >= 400:
                    raise RuntimeError(f"vllm_server {url} rejected a completion request (HTTP "
                                       f"{r.status_code}): {r.text[:500]}")
                choices = r.json().get("choices") or []
                if len(choices) != 1:
                    raise RuntimeError(f"vllm_server {url}: expected one choice, got {len(choices)}")
                with self._lock:
                    self.served_by[url] += 1
                return parse_choice(choices[0])
            except _Retryable as exc:
                if exc.transport:
                    self.pool.mark_down(url, exc.why)
                failed.append(url)
                last = exc
                if attempt < self.retries:
                    log.warning("vllm_server: %s (try %d of %d)", exc, attempt + 1, self.retries + 1)
                    time.sleep(min(0.2 * 2 ** attempt, 2.0))
            finally:
                self.pool.release(url)
        raise InfraError(f"vllm_server: completion failed after {self.retries + 1} tries, last on {last}")

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 cache_keys: list[str] | None = None) -> list[Sample]:
        """One reply per prompt; rows go to the servers concurrently. ``cache_keys`` is accepted
        for the protocol; the servers' prefix caches find shared prefixes by themselves."""
        if not prompts:
            return []
        check_prompts(prompts, cache_keys, params)
        if self._closed:
            raise RuntimeError("generate: the engine is closed")

        def run(batch: list[list[int]], fields: list[dict[str, Any]]) -> list[Piece]:
            self.prefilled_tokens += sum(len(p) for p in batch)
            if len(batch) == 1:
                return [self._complete(batch[0], fields[0])]
            with ThreadPoolExecutor(max_workers=min(len(batch), self.max_concurrency)) as ex:
                return list(ex.map(self._complete, batch, fields))

        t0 = time.perf_counter()
        try:
            samples = generate_with_stop_rule(prompts, params, self.tokenizer, run)
        finally:
            self.generate_seconds += time.perf_counter() - t0
        self.generated_tokens += sum(len(s.token_ids) for s in samples)
        return samples

    def choose(self, prompts: list[list[int]], choices: list[list[list[int]]], params: SamplingParams,
               cache_keys: list[str] | None = None) -> list[Sample]:
        raise NotImplementedError("rollout.constrain_actions is implemented by the hf engine only; set "
                                  "rollout.engine: hf or rollout.constrain_actions: false")

    def release(self, keys: Iterable[str]) -> None:
        """Nothing to drop: the servers' prefix caches are content-addressed."""
        for _ in keys:
            pass

    # -- weights -----------------------------------------------------------------------------
    syncs_adapters = True  # the pipeline hands this engine LoRA adapters, not merged weights

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        raise NotImplementedError(
            "rollout.engine=vllm_server syncs weights by LoRA adapter only (update_adapter): vLLM "
            "0.32 has no weight-reload route that works on its CPU backend; set trainer.lora, or use "
            "rollout.engine: vllm (see docs/scale-out.md)")

    def update_adapter(self, save: Callable[[Path], Any]) -> str:
        """``save(folder)`` writes the new adapter (peft format) into ``folder``; every live server
        loads it, ``GET /v1/models`` must list it, then the previous adapter is unloaded and later
        requests use the new one. Returns the adapter's name."""
        version = self.weights_version + 1
        name = f"agentgym-{self._run_tag}-v{version}"
        folder = (self.adapter_dir / name).resolve()
        if folder.exists():
            shutil.rmtree(folder)
        save(folder)
        if not (folder / "adapter_config.json").is_file():
            raise RuntimeError(f"update_adapter: {folder} has no adapter_config.json after saving")
        previous = self.adapter
        loaded_on = 0
        for s in self.pool.servers:
            if not s.alive:
                continue  # loaded when it is back (before its next request)
            try:
                self._load_on(s.url, name, str(folder))
                loaded_on += 1
            except _Retryable as exc:
                self.pool.mark_down(s.url, exc.why)
        if loaded_on == 0:
            raise InfraError(f"update_adapter: no live vllm_server could load adapter {name}; "
                             f"servers: {self.pool.snapshot()}")
        with self._lock:
            self.adapter = (name, str(folder))
            self.weights_version = version
        if previous is not None:
            for s in self.pool.servers:
                if s.alive:
                    self._unload_on(s.url, previous[0])
            shutil.rmtree(previous[1], ignore_errors=True)
        return name

    def _ensure_adapter(self, url: str) -> None:
        """Load the current adapter on ``url`` if it does not have it (missed a load, restarted)."""
        adapter = self.adapter
        if adapter is None or self._loaded.get(url) == adapter[0]:
            return
        with self._server_locks[url]:
            if self._loaded.get(url) != adapter[0]:
                self._load_on(url, *adapter)

    def _load_on(self, url: str, name: str, path: str) -> None:
        r = self._post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        if r.status_code == 404:
            raise RuntimeError(f"vllm_server {url} has no /v1/load_lora_adapter: start it with "
                               "--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
        if r.status_code >= 400:
            raise RuntimeError(f"vllm_server {url} could not load adapter {name} from {path} (HTTP "
                               f"{r.status_code}): {r.text[:500]}. The server reads the path itself: "
                               "rollout.adapter_dir must be a folder it sees at the same path, and "
                               "--max-lora-rank at least trainer.lora.r")
        listed = self._client.get(f"{url}/v1/models").json().get("data", [])
        if not any(m.get("id") == name for m in listed):
            raise RuntimeError(f"vllm_server {url} answered the load of {name} but does not list it")
        with self._lock:
            self._loaded[url] = name

    def _unload_on(self, url: str, name: str) -> None:
        try:
            r = self._client.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name})
            if r.status_code >= 400:
                log.warning("vllm_server %s: unloading %s answered HTTP %s", url, name, r.status_code)
        except httpx.HTTPError as exc:  # the adapter is unused from now on; not fatal
            log.warning("vllm_server %s: unloading %s failed: %s", url, name, exc)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._client.close()
        if self._own_adapter_dir:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)
