"""Serve any in-process adapter over the AgentGym HTTP protocol.

``create_app("babyai")`` returns a FastAPI app; :func:`serve` runs it with uvicorn. Routes
(``id`` may also be spelled ``env_idx``, the task index ``data_idx``/``idx``):

* ``POST /create``                          -> ``{"id": int}``
* ``POST /reset {id, data_idx, seed?}``     -> ``{"id", "observation", "reward": 0, "done": false, "info",
  "system_prompt"}`` (``system_prompt``: the instance's, as ``GET /system_prompt`` answers it, so
  a client needs no request for it; left out where the adapter's ``system_prompt()`` fails)
* ``POST /step {id, action}``               -> ``{"observation", "reward", "done", "terminated",
  "truncated", "info"}`` (``done = terminated or truncated``); ``action`` is the raw model reply,
  parsed by the adapter
* ``GET /observation?id=``                  -> the current observation (a JSON string, as in AgentGym)
* ``POST /close {id}``                      -> ``{"id", "closed": true}``
* ``GET /health``                           -> ``{"status": "ok", "env", "envs", "max_envs", ...}``
* ``GET /system_prompt?id=``, ``GET /valid_actions?id=``, ``GET /detail?id=``

Errors follow AgentGym: HTTP 200 with ``{"error": "...", "code": ...}`` (``code`` is one of
``bad_request``, ``unknown_id``, ``capacity``, ``env_error``), never a 5xx for an environment
fault, so a client can tell "the environment failed" from "the server is gone".

Concurrency: each environment instance has its own lock (calls on one instance are
serialised, calls on different instances run in parallel); blocking adapter calls run in the
worker thread pool, never on the event loop. At most ``max_envs`` instances live at once
(``/create`` beyond that answers ``code: capacity``). A background thread closes instances idle
for longer than ``idle_timeout_s`` (clients that crashed without ``/close``, or never close).

Limits against abusive or broken clients (``env_adapters.http_limits``; ``agentgym env serve``
options in brackets): a body over ``max_body_bytes`` (default 1 MiB) [``--max-body-bytes``] is
answered HTTP 413; a request whose head or body is not received within ``request_timeout_s``
(default 30 s) [``--request-timeout``] is answered 408 and its connection closed; beyond
``max_connections`` (default 512) [``--max-connections``] open connections new requests get
503. These are transport errors, hence HTTP statuses; everything the protocol itself refuses
(malformed JSON, unknown ids, capacity) stays an HTTP 200 error payload as above. The server
binds to 127.0.0.1 unless told otherwise (``host``): it executes whatever a client sends.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

import env_adapters
from env_adapters.base import TextEnv, utf8_safe
from env_adapters.http_limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_REQUEST_TIMEOUT_S,
    BodyLimits,
    head_deadline_protocol,
)

log = logging.getLogger(__name__)


class EnvRequestError(Exception):
    """A request the pool refuses; ``code`` goes into the error payload."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


@dataclass
class _Slot:
    env: TextEnv
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = field(default_factory=time.monotonic)
    closed: bool = False
    observation: str = ""
    task_id: int | None = None
    seed: int | None = None
    steps: int = 0
    done: bool = False
    created_at: float = field(default_factory=time.time)


def _jsonable(obj: Any, depth: int = 0) -> Any:
    """Make an adapter's info dict JSON-safe (numpy scalars, tuples, NaN, objects)."""
    if depth > 20:
        return str(obj)
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_jsonable(v, depth + 1) for v in obj]
    item = getattr(obj, "item", None)  # numpy / torch scalars
    if callable(item):
        try:
            return _jsonable(item(), depth + 1)
        except Exception:  # noqa: BLE001 - arrays with more than one element
            pass
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        try:
            return _jsonable(tolist(), depth + 1)
        except Exception:  # noqa: BLE001
            pass
    return str(obj)


class EnvPool:
    """Thread-safe registry of live environment instances with a cap and idle reaping."""

    def __init__(self, factory: Callable[[], TextEnv], max_envs: int, idle_timeout_s: float):
        if max_envs < 1:
            raise ValueError("max_envs must be >= 1")
        if idle_timeout_s <= 0:
            raise ValueError("idle_timeout_s must be > 0")
        self._factory = factory
        self.max_envs = max_envs
        self.idle_timeout_s = idle_timeout_s
        self._slots: dict[int, _Slot] = {}
        self._pending = 0  # creations in progress (count against max_envs)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self.reaped = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)

    def create(self) -> int:
        with self._lock:
            if len(self._slots) + self._pending >= self.max_envs:
                raise EnvRequestError(
                    f"too many environments: max_envs={self.max_envs} are live; close some "
                    "(POST /close) or raise max_envs", "capacity")
            self._pending += 1
        try:
            env = self._factory()
        except BaseException:
            with self._lock:
                self._pending -= 1
            raise
        with self._lock:
            self._pending -= 1
            env_id = next(self._ids)
            self._slots[env_id] = _Slot(env)
        return env_id

    @contextlib.contextmanager
    def use(self, env_id: int) -> Iterator[_Slot]:
        """Hold instance ``env_id`` exclusively (waits for a concurrent call on it)."""
        with self._lock:
            slot = self._slots.get(env_id)
        if slot is None:
            raise EnvRequestError(f"unknown environment id {env_id} (never created, closed, "
                                  "or reaped after being idle)", "unknown_id")
        with slot.lock:
            if slot.closed:
                raise EnvRequestError(f"environment {env_id} was closed", "unknown_id")
            slot.last_used = time.monotonic()
            try:
                yield slot
            finally:
                slot.last_used = time.monotonic()

    def close(self, env_id: int) -> None:
        with self._lock:
            slot = self._slots.pop(env_id, None)
        if slot is None:
            raise EnvRequestError(f"unknown environment id {env_id}", "unknown_id")
        with slot.lock:  # wait for an in-flight call on it
            self._close_slot(env_id, slot)

    @staticmethod
    def _close_slot(env_id: int, slot: _Slot) -> None:
        if slot.closed:
            return
        slot.closed = True
        try:
            slot.env.close()
        except Exception:  # noqa: BLE001 - closing must not take the server down
            log.exception("closing environment %s failed", env_id)

    def reap(self, now: float | None = None) -> list[int]:
        """Close instances idle longer than ``idle_timeout_s``; busy ones are skipped."""
        now = time.monotonic() if now is None else now
        victims: list[tuple[int, _Slot]] = []
        with self._lock:
            for env_id, slot in list(self._slots.items()):
                if now - slot.last_used < self.idle_timeout_s:
                    continue
                if not slot.lock.acquire(blocking=False):
                    continue  # in use right now
                del self._slots[env_id]
                victims.append((env_id, slot))
        for env_id, slot in victims:
            try:
                self._close_slot(env_id, slot)
            finally:
                slot.lock.release()
            log.info("reaped environment %s (idle > %.0f s)", env_id, self.idle_timeout_s)
        self.reaped += len(victims)
        return [v[0] for v in victims]

    def start_reaper(self, interval_s: float) -> None:
        if self._reaper is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.reap()
                except Exception:  # noqa: BLE001
                    log.exception("reaper failed")

        self._reaper = threading.Thread(target=loop, name="env-reaper", daemon=True)
        self._reaper.start()

    def stop_reaper(self) -> None:
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
            self._reaper = None

    def close_all(self) -> None:
        with self._lock:
            slots = list(self._slots.items())
            self._slots.clear()
        for env_id, slot in slots:
            # do not wait forever on a call stuck in the adapter
            got = slot.lock.acquire(timeout=5)
            try:
                self._close_slot(env_id, slot)
            finally:
                if got:
                    slot.lock.release()


def _int_field(body: dict[str, Any], *names: str, default: Any = ...) -> int:
    for name in names:
        if name in body and body[name] is not None:
            value = body[name]
            if isinstance(value, (int, str)) and not isinstance(value, bool):
                try:
                    return int(value)
                except ValueError:
                    pass
            # present but not an integer: an error, never a silent fall back to the default task
            raise EnvRequestError(f"field {name!r} must be an integer, got {value!r}", "bad_request")
    if default is not ...:
        return default
    raise EnvRequestError(f"missing or non-integer field {names[0]!r}", "bad_request")


def create_app(env_name: str, max_envs: int = 64, idle_timeout_s: float = 600,
               env_kwargs: dict | None = None, *, reap_interval_s: float | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S):
    """A FastAPI app serving adapter ``env_name`` (built with ``make_env(env_name, **env_kwargs)``).

    ``reap_interval_s``: how often the reaper looks for idle instances (default
    ``min(idle_timeout_s / 4, 30)``). The pool is ``app.state.pool``. ``max_body_bytes`` and
    ``request_timeout_s`` bound each request's body (413 / 408, see the module doc); the
    deadline for request heads is the server's (:func:`uvicorn_options`).
    """
    if env_name not in env_adapters.ADAPTERS:
        raise ValueError(f"unknown environment {env_name!r}; choose one of "
                         f"{sorted(env_adapters.ADAPTERS)}")
    kwargs = dict(env_kwargs or {})
    interval = reap_interval_s if reap_interval_s is not None else min(idle_timeout_s / 4, 30.0)
    pool = EnvPool(lambda: env_adapters.make_env(env_name, **kwargs), max_envs, idle_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        import anyio.to_thread

        limiter = anyio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = max(limiter.total_tokens, max_envs + 8)
        pool.start_reaper(max(interval, 0.01))
        try:
            yield
        finally:
            pool.stop_reaper()
            await run_in_threadpool(pool.close_all)

    app = FastAPI(title=f"AgentGym env server: {env_name}", lifespan=lifespan)
    app.add_middleware(BodyLimits, max_body_bytes=max_body_bytes, request_timeout_s=request_timeout_s)
    app.state.pool = pool
    app.state.env_name = env_name

    def error(exc: BaseException) -> JSONResponse:
        if isinstance(exc, EnvRequestError):
            return JSONResponse({"error": str(exc), "code": exc.code})
        log.warning("%s env error: %s: %s", env_name, type(exc).__name__, exc)
        return JSONResponse({"error": f"{type(exc).__name__}: {exc}", "code": "env_error"})

    def answers_errors(route: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        """Any exception of ``route`` becomes the AgentGym error payload (HTTP 200)."""

        @functools.wraps(route)  # FastAPI reads the route's parameters through __wrapped__
        async def answered(*args: Any, **kwargs: Any) -> Any:
            try:
                # a Response goes out as it is: FastAPI's own path for a returned dict
                # (jsonable_encoder, response validation) was ~10 % of a request's server CPU,
                # and the routes' results are JSON-ready already (_jsonable)
                return JSONResponse(await route(*args, **kwargs))
            except Exception as exc:  # noqa: BLE001
                return error(exc)

        return answered

    async def body_of(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if not raw.strip():
            return {}
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than Python's stack
            raise EnvRequestError("request body is not valid JSON", "bad_request") from None
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise EnvRequestError("request body must be a JSON object", "bad_request")
        return data

    def env_id_of(body: dict[str, Any]) -> int:
        return _int_field(body, "id", "env_idx", "env_id")

    @app.get("/")
    async def hello() -> str:
        return f"This is environment {env_name}."

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "env": env_name, "envs": len(pool), "max_envs": max_envs,
                "idle_timeout_s": idle_timeout_s, "reaped": pool.reaped,
                "max_body_bytes": max_body_bytes, "request_timeout_s": request_timeout_s,
                "protocol": "agentgym"}

    @app.post("/create")
    @answers_errors
    async def create(request: Request):
        await body_of(request)  # accepted and ignored (AgentGym clients send various)
        env_id = await run_in_threadpool(pool.create)
        return {"id": env_id}

    @app.post("/reset")
    @answers_errors
    async def reset(request: Request):
        body = await body_of(request)
        env_id = env_id_of(body)
        task_id = _int_field(body, "data_idx", "idx", "task_id", default=0)
        seed = _int_field(body, "seed", default=0)

        def run() -> dict[str, Any]:
            with pool.use(env_id) as slot:
                obs, info = slot.env.reset(task_id, seed)
                slot.observation, slot.task_id, slot.seed = obs, task_id, seed
                slot.steps, slot.done = 0, False
                out = {"id": env_id, "observation": obs, "reward": 0.0, "done": False,
                       "info": _jsonable(info)}
                try:  # saves HTTPEnv a GET /system_prompt per episode (one request of 4 + horizon)
                    prompt = slot.env.system_prompt()
                except Exception:  # noqa: BLE001 - GET /system_prompt reports it, if asked
                    prompt = None
                if isinstance(prompt, str):
                    out["system_prompt"] = prompt
                return out

        return await run_in_threadpool(run)

    @app.post("/step")
    @answers_errors
    async def step(request: Request):
        body = await body_of(request)
        env_id = env_id_of(body)
        action = body.get("action")
        if action is None:
            raise EnvRequestError("missing field 'action'", "bad_request")
        if not isinstance(action, str):
            action = json.dumps(action)  # the adapter judges it, like any reply
        # a "\\udcff" escape parses to a lone surrogate: an adapter echoing it in its
        # observation would make the UTF-8 response fail (HTTP 500, an infra error)
        action = utf8_safe(action)

        def run() -> dict[str, Any]:
            with pool.use(env_id) as slot:
                if slot.task_id is None:
                    raise EnvRequestError(f"environment {env_id}: step before reset",
                                          "bad_request")
                res = slot.env.step(action)
                slot.observation = res.observation
                slot.steps += 1
                slot.done = bool(res.terminated or res.truncated)
                return {"observation": res.observation, "reward": float(res.reward),
                        "done": slot.done, "terminated": bool(res.terminated),
                        "truncated": bool(res.truncated), "info": _jsonable(res.info)}

        return await run_in_threadpool(run)

    def _get(env_id: int, fn: Callable[[_Slot], Any]) -> Any:
        with pool.use(env_id) as slot:
            return fn(slot)

    @app.get("/observation")
    @answers_errors
    async def observation(id: int | None = None, env_idx: int | None = None):  # noqa: A002
        env_id = _int_field({"id": id, "env_idx": env_idx}, "id", "env_idx")
        return await run_in_threadpool(_get, env_id, lambda s: s.observation)

    prompt_cache: dict[str, str] = {}

    @app.get("/system_prompt")
    @answers_errors
    async def system_prompt(id: int | None = None):  # noqa: A002
        if id is None:  # no instance yet: ask a throwaway one (once)
            def probe() -> str:
                if "prompt" not in prompt_cache:
                    env = env_adapters.make_env(env_name, **kwargs)
                    try:
                        prompt_cache["prompt"] = env.system_prompt()
                    finally:
                        env.close()
                return prompt_cache["prompt"]
            return await run_in_threadpool(probe)
        return await run_in_threadpool(_get, id, lambda s: s.env.system_prompt())

    @app.get("/valid_actions")
    @answers_errors
    async def valid_actions(id: int):  # noqa: A002
        return await run_in_threadpool(_get, id, lambda s: _jsonable(s.env.valid_actions()))

    @app.get("/detail")
    @answers_errors
    async def detail(id: int):  # noqa: A002
        return await run_in_threadpool(_get, id, lambda s: {
            "id": id, "observation": s.observation, "task_id": s.task_id, "seed": s.seed,
            "steps": s.steps, "done": s.done, "created_at": s.created_at})

    @app.post("/close")
    @answers_errors
    async def close(request: Request):
        body = await body_of(request)
        env_id = env_id_of(body)
        await run_in_threadpool(pool.close, env_id)
        return {"id": env_id, "closed": True}

    return app


_APP_KEYS = ("max_envs", "idle_timeout_s", "env_kwargs", "reap_interval_s", "max_body_bytes")


def uvicorn_options(request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                    max_connections: int = DEFAULT_MAX_CONNECTIONS) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments that apply the server's connection limits: a
    deadline for request heads and a cap on open connections (see the module doc)."""
    return {"http": head_deadline_protocol(request_timeout_s), "limit_concurrency": max_connections}


def serve(env_name: str, host: str = "127.0.0.1", port: int = 8001, *,
          request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
          max_connections: int = DEFAULT_MAX_CONNECTIONS, **kw: Any) -> None:
    """Run the server for ``env_name`` on ``host`` (loopback by default) (blocking). ``kw``:
    :func:`create_app` arguments (``max_envs``, ``idle_timeout_s``, ``env_kwargs``,
    ``reap_interval_s``, ``max_body_bytes``); the rest go to ``uvicorn.run`` (e.g. ``log_level``)."""
    import uvicorn

    app_kw = {k: kw.pop(k) for k in _APP_KEYS if k in kw}
    kw.setdefault("log_level", "info")
    uvicorn.run(create_app(env_name, request_timeout_s=request_timeout_s, **app_kw), host=host, port=port,
                **uvicorn_options(request_timeout_s, max_connections), **kw)


__all__ = ["EnvPool", "EnvRequestError", "create_app", "serve", "uvicorn_options"]
