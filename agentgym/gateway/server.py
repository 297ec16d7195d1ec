"""The gateway over HTTP: an OpenAI-compatible endpoint per episode (Starlette, served by uvicorn).

Routes (``{id}``: the episode id; ``OpenAI(base_url=f"http://HOST:PORT/episodes/{id}/v1")``
works unchanged):

* ``POST /episodes/{id}/v1/chat/completions``: ``messages``, ``tools``, ``max_tokens`` /
  ``max_completion_tokens``, ``seed``, ``stop``, ``logprobs`` (and ``temperature`` / ``top_p``
  where the gateway honors them: ``GatewaySettings.honor_sampling``) -> a ``chat.completion``
  whose message holds the reply, its ``<tool_call>`` blocks as ``tool_calls`` (``finish_reason``
  ``tool_calls``) and the text outside them as the content; ``stream: true`` and ``n`` > 1
  are refused (400);
* ``GET /episodes/{id}/v1/models`` (and ``/models/{name}``): the served policy;
* ``POST /episodes/{id}/reward`` ``{"reward": float, "success": bool?}``: the episode's outcome;
* ``POST /episodes/{id}/end``: ends the episode (it goes to the store) -> its summary;
* ``GET /health``.

Every refusal is a JSON error in OpenAI's form ``{"error": {"message", "type", "param", "code"}}``
with a 4xx status (malformed JSON or messages 400, unknown or ended episode 404, a body over
``max_body_bytes`` 413); an engine failure is a 500 of that request. No request stops the server.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentgym.gateway.messages import RequestError, parse_request
from agentgym.gateway.recorder import Gateway

DEFAULT_MAX_BODY_BYTES = 32 << 20  # a long agent conversation with its tool results


def _error(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _json(request: Request, limit: int) -> Any:
    """The request's JSON body, read up to ``limit`` bytes (RequestError 413 past it, 400 if
    it is not JSON)."""
    too_large = RequestError(f"the request body is larger than the gateway's limit of {limit} bytes",
                             status=413, code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks) or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None


def create_app(gateway: Gateway, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Any:
    """The ASGI app serving ``gateway`` (see the module doc)."""

    async def chat(request: Request) -> JSONResponse:
        episode_id = request.path_params["episode_id"]
        try:
            req = parse_request(await _json(request, max_body_bytes))
            return JSONResponse(await run_in_threadpool(gateway.chat, episode_id, req))
        except RequestError as e:
            return _error(e)

    async def models(request: Request) -> JSONResponse:
        try:
            await run_in_threadpool(gateway.check, request.path_params["episode_id"])
        except RequestError as e:
            return _error(e)
        body = gateway.models()
        name = request.path_params.get("model")
        if name is None:
            return JSONResponse(body)
        if name != gateway.settings.model_name:
            return _error(RequestError(f"unknown model {name!r}; this gateway serves "
                                       f"{gateway.settings.model_name!r}", status=404, code="model_not_found",
                                       kind="not_found_error"))
        return JSONResponse(body["data"][0])

    async def reward(request: Request) -> JSONResponse:
        episode_id = request.path_params["episode_id"]
        try:
            body = await _json(request, max_body_bytes)
            if not isinstance(body, dict) or "reward" not in body:
                raise RequestError('the body must be {"reward": number, "success": bool?}', param="reward")
            await run_in_threadpool(gateway.set_reward, episode_id, body["reward"], body.get("success"))
        except RequestError as e:
            return _error(e)
        return JSONResponse({"episode_id": episode_id, "reward": body["reward"]})

    async def end(request: Request) -> JSONResponse:
        try:
            return JSONResponse(await run_in_threadpool(gateway.end, request.path_params["episode_id"]))
        except RequestError as e:
            return _error(e)

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "model": gateway.settings.model_name,
                             "open_episodes": len(gateway.open_ids())})

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        detail = exc.detail if isinstance(exc, HTTPException) else f"{type(exc).__name__}: {exc}"
        if status == 404:
            detail = (f"no route {request.method} {request.url.path}; the gateway serves "
                      "/episodes/{episode_id}/v1/chat/completions, /v1/models, /reward and /end")
        kind = "server_error" if status >= 500 else "invalid_request_error"
        return JSONResponse({"error": {"message": str(detail), "type": kind, "param": None,
                                       "code": str(status)}}, status_code=status)

    base = "/episodes/{episode_id}"
    app = Starlette(routes=[
        Route(base + "/v1/chat/completions", chat, methods=["POST"]),
        Route(base + "/v1/models", models, methods=["GET"]),
        Route(base + "/v1/models/{model:path}", models, methods=["GET"]),
        Route(base + "/reward", reward, methods=["POST"]),
        Route(base + "/end", end, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ], exception_handlers={HTTPException: http_error, Exception: http_error})
    return app


class GatewayServer:
    """``create_app(gateway)`` served by uvicorn in a daemon thread on ``host`` (loopback by
    default) and ``port`` (0: a free one, bound before the thread starts, so no other process
    can take it in between). ``url``: the server's root; :meth:`episode_url` an episode's
    OpenAI base URL. A context manager: leaving it stops the server."""

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int = 0, *,
                 log_level: str = "warning", start_timeout_s: float = 30.0):
        import uvicorn

        self.gateway = gateway
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(create_app(gateway), log_level=log_level, lifespan="off",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="gateway-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the gateway server on {self.url} did not start")
            time.sleep(0.01)

    def episode_url(self, episode_id: str) -> str:
        return f"{self.url}/episodes/{episode_id}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(timeout=5)
        self.sock.close()

    def __enter__(self) -> "GatewayServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(gateway: Gateway, host: str = "127.0.0.1", port: int = 8100, log_level: str = "info") -> None:
    """Serve ``gateway`` on ``host:port`` until interrupted (blocking)."""
    import uvicorn

    uvicorn.Server(uvicorn.Config(create_app(gateway), host=host, port=port, log_level=log_level,
                                  lifespan="off", timeout_graceful_shutdown=5)).run()
