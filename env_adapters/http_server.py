"""Serve any in-process adapter over HTTP, as AgentGym's environment servers do.

``create_app("babyai")`` returns a FastAPI app; :func:`serve` runs it with uvicorn. Routes:
``POST /create``, ``POST /reset``, ``POST /step``, ``GET /observation``, ``POST /close`` with the
bodies and answers of a *dialect* (``env_adapters.http_server_dialects``): by default the
environment's own AgentGym server's (so AgentGym's and AgentGym-RL's client classes work
unchanged), or per request the one named by the ``X-AgentGym-Dialect`` header (this project's
``HTTPEnv`` sends ``agentgym``). In the ``agentgym`` dialect:

* ``POST /create``                          -> ``{"id": int}``
* ``POST /reset {id, data_idx, seed?}``     -> ``{"id", "observation", "reward": 0, "done": false, "info",
  "system_prompt", "tools"?}`` (``system_prompt``: the instance's, as ``GET /system_prompt`` answers it, so
  a client needs no request for it; left out where the adapter's ``system_prompt()`` fails;
  ``tools``: the episode's tool schemas, as ``GET /tools`` answers them, only for an adapter
  whose ``tools()`` is not ``None``: function calls as actions, ``env_adapters.tool_calls``)
* ``POST /step {id, action}``               -> ``{"observation", "reward", "done", "terminated",
  "truncated", "info"}`` (``done = terminated or truncated``); ``action`` is the raw model reply,
  parsed by the adapter. A tool environment's ``info`` carries the step's ``tool_results``
  (``[{"tool_call_id", "name", "content"}]``) and ``tool_calls`` (OpenAI's form) as the adapter
  gave them, so the client's rollout renders them as tool messages
* ``GET /observation?id=``                  -> the current observation (a JSON string, as in AgentGym)
* ``POST /close {id}``                      -> ``{"id", "closed": true}``

In every dialect: ``GET /health`` -> ``{"status": "ok", "env", "dialect", "envs", "max_envs",
...}``; ``GET /system_prompt``, ``GET /valid_actions``, ``GET /tools`` (the instance's tool schemas
since its last reset, or ``null``: an environment of text commands), ``GET /detail`` (the
instance named as the dialect names it).

Errors follow AgentGym: HTTP 200 with ``{"error": "...", "code": ...}`` (``code`` is one of
``bad_request``, ``unknown_id``, ``capacity``, ``env_error``), never a 5xx for an environment
fault, so a client can tell "the environment failed" from "the server is gone". One exception:
a request that does not name exactly one instance (none, or an instance key its dialect does
not use beside the one it does) is HTTP 400 and changes nothing: a request cannot change an
instance it does not name. Instance ids are random integers from a large range, never small
task-like numbers.

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
import json
import logging
import math
import random
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
from env_adapters.tool_calls import checked_tools
from env_adapters.http_limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_REQUEST_TIMEOUT_S,
    BodyLimits,
    head_deadline_protocol,
)
from env_adapters.http_server_dialects import (
    DIALECT_HEADER,
    EnvRequestError,
    ServerDialect,
    default_dialect,
    request_dialect,
)

log = logging.getLogger(__name__)

#: instance ids are drawn from [ID_MIN, ID_MAX): far above any task index, within int32
ID_MIN, ID_MAX = 1_000_000, 2**31 - 1


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
    # what the dialects answer with (http_server_dialects): the last reset's or step's
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    reset_info: dict[str, Any] = field(default_factory=dict)  # the last reset's info
    system_prompt: str | None = None
    tools: list[dict[str, Any]] | None = None  # the adapter's tools() after the last reset
    episode_return: float = 0.0  # the sum of the episode's rewards (BabyAI's "score")
    previous_score: float = 0.0  # info["score"] before the last step (SciWorld's "reward")


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
        # random ids from a large range: a task index or a stale id sent where an instance
        # belongs names no instance, instead of another client's
        self._ids = random.Random()
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
            env_id = self._ids.randrange(ID_MIN, ID_MAX)
            while env_id in self._slots:
                env_id = self._ids.randrange(ID_MIN, ID_MAX)
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


def create_app(env_name: str, max_envs: int = 64, idle_timeout_s: float = 600,
               env_kwargs: dict | None = None, *, reap_interval_s: float | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, dialect: str | None = None):
    """A FastAPI app serving adapter ``env_name`` (built with ``make_env(env_name, **env_kwargs)``).

    ``dialect``: the default dialect of its answers (``None`` / ``"native"``: the environment's
    AgentGym one, see ``env_adapters.http_server_dialects``); a request's ``X-AgentGym-Dialect``
    header overrides it. ``reap_interval_s``: how often the reaper looks for idle instances
    (default ``min(idle_timeout_s / 4, 30)``). The pool is ``app.state.pool``. ``max_body_bytes``
    and ``request_timeout_s`` bound each request's body (413 / 408, see the module doc); the
    deadline for request heads is the server's (:func:`uvicorn_options`).
    """
    if env_name not in env_adapters.ADAPTERS:
        raise ValueError(f"unknown environment {env_name!r}; choose one of "
                         f"{sorted(env_adapters.ADAPTERS)}")
    served = default_dialect(env_name, dialect)
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
    app.state.dialect = served.name

    def error(exc: BaseException) -> JSONResponse:
        if isinstance(exc, EnvRequestError):
            return JSONResponse({"error": str(exc), "code": exc.code}, status_code=exc.status)
        log.warning("%s env error: %s: %s", env_name, type(exc).__name__, exc)
        return JSONResponse({"error": f"{type(exc).__name__}: {exc}", "code": "env_error"})

    def answers_errors(route: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        """Any exception of ``route`` becomes the AgentGym error payload (HTTP 200, or the
        status an :class:`EnvRequestError` carries)."""

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

    def dialect_of(request: Request) -> ServerDialect:
        return request_dialect(request.headers.get(DIALECT_HEADER), served)

    def reset_slot(slot: _Slot, task_id: int, seed: int) -> None:
        """Reset ``slot``'s instance (its lock held) and record what every dialect answers with."""
        obs, info = slot.env.reset(task_id, seed)
        slot.observation, slot.task_id, slot.seed = obs, task_id, seed
        slot.steps, slot.done, slot.reward, slot.episode_return = 0, False, 0.0, 0.0
        slot.info = slot.reset_info = _jsonable(info)
        slot.previous_score = _score(slot.info)
        try:  # saves HTTPEnv a GET /system_prompt per episode (one request of 4 + horizon)
            prompt = slot.env.system_prompt()
        except Exception:  # noqa: BLE001 - GET /system_prompt reports it, if asked
            prompt = None
        slot.system_prompt = prompt if isinstance(prompt, str) else None
        # the episode's tools: a malformed list is the adapter's fault, answered as an env error
        slot.tools = checked_tools(_jsonable(slot.env.tools()))

    @app.get("/")
    async def hello() -> str:
        return f"This is environment {env_name}."

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "env": env_name, "dialect": served.name, "envs": len(pool), "max_envs": max_envs,
                "idle_timeout_s": idle_timeout_s, "reaped": pool.reaped,
                "max_body_bytes": max_body_bytes, "request_timeout_s": request_timeout_s,
                "protocol": "agentgym"}

    @app.post("/create")
    @answers_errors
    async def create(request: Request):
        d = dialect_of(request)
        body = await body_of(request)  # AgentGym clients send various bodies
        task_id = d.create_task(body)

        def run() -> Any:
            env_id = pool.create()
            try:
                with pool.use(env_id) as slot:
                    if task_id is not None:  # TextCraft's and Deep Search's servers start the instance
                        reset_slot(slot, task_id, 0)
                    return d.create_answer(env_id, slot)
            except BaseException:
                pool.close(env_id)  # the client never learns its id: nobody else would close it
                raise

        return await run_in_threadpool(run)

    @app.post("/reset")
    @answers_errors
    async def reset(request: Request):
        d = dialect_of(request)
        body = await body_of(request)
        env_id = d.instance(body, "reset")
        task_id, seed = d.task(body), d.seed(body)

        def run() -> Any:
            with pool.use(env_id) as slot:
                reset_slot(slot, task_id, seed)
                return d.reset_answer(env_id, slot)

        return await run_in_threadpool(run)

    @app.post("/step")
    @answers_errors
    async def step(request: Request):
        d = dialect_of(request)
        body = await body_of(request)
        env_id = d.instance(body, "step")
        action = body.get("action")
        if action is None:
            raise EnvRequestError("missing field 'action'", "bad_request")
        if not isinstance(action, str):
            action = json.dumps(action)  # the adapter judges it, like any reply
        # a "\\udcff" escape parses to a lone surrogate: an adapter echoing it in its
        # observation would make the UTF-8 response fail (HTTP 500, an infra error)
        action = utf8_safe(action)

        def run() -> Any:
            with pool.use(env_id) as slot:
                if slot.task_id is None:
                    raise EnvRequestError(f"environment {env_id}: step before reset",
                                          "bad_request")
                res = slot.env.step(action)
                slot.previous_score = _score(slot.info)
                slot.observation, slot.reward, slot.info = res.observation, float(res.reward), _jsonable(res.info)
                slot.episode_return += slot.reward
                slot.steps += 1
                slot.done = bool(res.terminated or res.truncated)
                return d.step_answer(slot, bool(res.terminated), bool(res.truncated))

        return await run_in_threadpool(run)

    def _get(request: Request, route: str, fn: Callable[[ServerDialect, _Slot], Any]) -> Any:
        """``fn(dialect, slot)`` for the instance a GET request names (in its query string)."""
        d = dialect_of(request)
        env_id = d.instance(dict(request.query_params), route)
        with pool.use(env_id) as slot:
            return fn(d, slot)

    @app.get("/observation")
    @answers_errors
    async def observation(request: Request):
        return await run_in_threadpool(_get, request, "observation", lambda d, s: d.observation_answer(s))

    prompt_cache: dict[str, str] = {}

    @app.get("/system_prompt")
    @answers_errors
    async def system_prompt(request: Request):
        d = dialect_of(request)
        if request.query_params.get(d.instance_key) is None:  # no instance yet: ask a throwaway one (once)
            def probe() -> str:
                if "prompt" not in prompt_cache:
                    env = env_adapters.make_env(env_name, **kwargs)
                    try:
                        prompt_cache["prompt"] = env.system_prompt()
                    finally:
                        env.close()
                return prompt_cache["prompt"]
            return await run_in_threadpool(probe)
        return await run_in_threadpool(_get, request, "system_prompt", lambda d, s: s.env.system_prompt())

    @app.get("/valid_actions")
    @answers_errors
    async def valid_actions(request: Request):
        return await run_in_threadpool(_get, request, "valid_actions", lambda d, s: _jsonable(s.env.valid_actions()))

    @app.get("/tools")
    @answers_errors
    async def tools(request: Request):
        return await run_in_threadpool(_get, request, "tools", lambda d, s: s.tools)

    @app.get("/detail")
    @answers_errors
    async def detail(request: Request):
        return await run_in_threadpool(_get, request, "detail", lambda d, s: {
            "observation": s.observation, "task_id": s.task_id, "seed": s.seed, "steps": s.steps,
            "done": s.done, "reward": s.reward, "deleted": False, "created_at": s.created_at})

    @app.get("/task_description")
    @answers_errors
    async def task_description(request: Request):  # AgentGym's SciWorld server has it
        return await run_in_threadpool(_get, request, "task_description", lambda d, s: {
            "task_description": str(s.reset_info.get("task_description") or "")})

    @app.post("/close")
    @answers_errors
    async def close(request: Request):
        d = dialect_of(request)
        body = await body_of(request)
        env_id = d.instance(body, "close")
        await run_in_threadpool(pool.close, env_id)
        return d.close_answer(env_id)

    return app


def _score(info: dict[str, Any]) -> float:
    """An adapter's running ``info["score"]`` (SciWorld's 0..100), 0 where it reports none."""
    value = info.get("score", 0)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


_APP_KEYS = ("max_envs", "idle_timeout_s", "env_kwargs", "reap_interval_s", "max_body_bytes", "dialect")


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
    ``reap_interval_s``, ``max_body_bytes``, ``dialect``); the rest go to ``uvicorn.run`` (e.g. ``log_level``)."""
    import uvicorn

    app_kw = {k: kw.pop(k) for k in _APP_KEYS if k in kw}
    kw.setdefault("log_level", "info")
    uvicorn.run(create_app(env_name, request_timeout_s=request_timeout_s, **app_kw), host=host, port=port,
                **uvicorn_options(request_timeout_s, max_connections), **kw)


__all__ = ["EnvPool", "EnvRequestError", "create_app", "serve", "uvicorn_options"]
