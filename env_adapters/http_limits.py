"""Limits that keep the environment server up under abusive clients (``http_server``).

uvicorn alone waits forever for a request whose headers or body never finish, and reads a body
of any size (measured: a client that sent half its headers, or a body shorter than its
``Content-Length``, held its connection indefinitely; a 20 MB body was read whole). So:

* ``BodyLimits`` (ASGI middleware): a request body larger than ``max_body_bytes`` is answered
  ``413`` (at once when ``Content-Length`` says so, else as soon as the bytes read exceed it);
  a body not complete within ``request_timeout_s`` is answered ``408``. The body is read in
  full before the route runs (the protocol's bodies are small JSON objects).
* ``head_deadline_protocol``: uvicorn's HTTP/1.1 protocol plus a deadline for each request's
  line and headers (``request_timeout_s`` from the connection's start or the previous response):
  a partial head past it is answered ``408`` and the connection closed; an idle keep-alive
  connection is closed by uvicorn's own keep-alive timeout, as before. The protocol class and the
  503 answer below are patches of uvicorn, in ``agentgym.patches.uvicorn``.
* ``max_connections`` (uvicorn's ``limit_concurrency``): a request that arrives while the server
  holds ``max_connections`` open connections (its own included) or requests in flight is
  answered ``503`` and its connection closed; the server takes requests again as soon as
  connections close (``HTTPEnv`` retries a 503 with backoff).

Each refusal carries the protocol's error payload ``{"error": ..., "code": ...}`` with the
codes ``too_large``, ``timeout`` and ``busy`` (the 503: uvicorn's own body was the plain text
"Service Unavailable", which named no limit).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from agentgym.patches.uvicorn import answer_refused_requests_with, head_deadline_h11_protocol

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a step's body is a model reply (a few KB at most)
DEFAULT_REQUEST_TIMEOUT_S = 30.0  # to send a request's head, and again its body
DEFAULT_MAX_CONNECTIONS = 512  # open connections (and in-flight requests) before 503


class _TooLarge(Exception):
    pass


def _error_body(message: str, code: str) -> bytes:
    return json.dumps({"error": message, "code": code}).encode()


class BodyLimits:
    """ASGI middleware: read each HTTP request's body within ``max_body_bytes`` and
    ``request_timeout_s``, or answer 413 / 408 without calling the app."""

    def __init__(self, app: Any, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S):
        if max_body_bytes < 1 or request_timeout_s <= 0:
            raise ValueError("max_body_bytes must be >= 1 and request_timeout_s > 0")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.request_timeout_s = request_timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            body = await asyncio.wait_for(self._read(scope, receive), self.request_timeout_s)
        except _TooLarge:
            return await self._refuse(send, 413, f"request body larger than max_body_bytes="
                                      f"{self.max_body_bytes}", "too_large")
        except asyncio.TimeoutError:
            return await self._refuse(send, 408, f"request body not received within "
                                      f"request_timeout_s={self.request_timeout_s:g}", "timeout")
        if body is None:  # the client went away mid-body: nobody to answer
            return None
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # afterwards: the disconnect, when it comes

        return await self.app(scope, replay, send)

    async def _read(self, scope: dict, receive: Any) -> bytes | None:
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_body_bytes:
            raise _TooLarge
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    async def _refuse(send: Any, status: int, message: str, code: str) -> None:
        body = _error_body(message, code)
        # "connection: close": the rest of the body is never read, so the connection is done
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


async def _busy(scope: dict, receive: Any, send: Any) -> None:
    """The 503 answer beyond ``max_connections``, as a protocol error payload."""
    body = _error_body("server busy: it holds max_connections open connections (agentgym env serve "
                       "--max-connections); retry later, or raise the limit", "busy")
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def head_deadline_protocol(request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> type:
    """The uvicorn ``http`` protocol class enforcing ``request_timeout_s`` on request heads
    (``agentgym.patches.uvicorn.head_deadline_h11_protocol``; the 408 carries a ``timeout`` error).

    Also makes uvicorn's h11 protocol answer ``max_connections`` refusals with ``_busy``, for
    every h11 server of this process (``agentgym.patches.uvicorn.answer_refused_requests_with``:
    uvicorn has no hook per server; the body is the only change)."""
    timeout_s = float(request_timeout_s)
    answer_refused_requests_with(_busy)
    body = _error_body(f"request head not received within request_timeout_s={timeout_s:g}", "timeout")
    return head_deadline_h11_protocol(timeout_s, body)


__all__ = ["BodyLimits", "DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_CONNECTIONS",
           "DEFAULT_REQUEST_TIMEOUT_S", "head_deadline_protocol"]
