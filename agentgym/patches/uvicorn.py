"""Patches of uvicorn's HTTP/1.1 (h11) protocol, written for uvicorn 0.54 - 0.55 (pinned and
tested: 0.55.0 with h11 0.16.0, constraints/*.txt). ``env_adapters.http_limits`` uses both for
the environment server.

* :func:`answer_refused_requests_with`: the app that answers requests beyond ``limit_concurrency``
  (process-wide, every h11 server);
* :func:`head_deadline_h11_protocol`: an h11 protocol class with a deadline for each request head
  (a subclass built on uvicorn's protocol internals, handed to uvicorn's ``http`` setting).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from agentgym.patches import require_attribute, require_source, require_version

SUPPORTED = ">=0.54,<0.56"


def answer_refused_requests_with(app: Any) -> None:
    """Make uvicorn's h11 protocol answer a request refused by ``limit_concurrency`` with the
    ASGI ``app`` (called as ``app(scope, receive, send)``).

    ``H11Protocol.handle_events`` answers a request that arrives while the server holds
    ``limit_concurrency`` connections or tasks by running the module global
    ``uvicorn.protocols.http.h11_impl.service_unavailable``, whose body is the plain text
    "Service Unavailable" (naming no limit, in no protocol's error format). uvicorn has no
    setting per server for it, so that global is replaced: for every h11 server of this process.
    The status and the closing of the connection stay the caller's app's to send.
    """
    name = f"{__name__}.answer_refused_requests_with"
    check = ("that H11Protocol.handle_events in uvicorn/protocols/http/h11_impl.py still answers "
             "a request over limit_concurrency with the module global service_unavailable")
    require_version(name, "uvicorn", SUPPORTED, check)
    from uvicorn.protocols.http import h11_impl

    require_attribute(name, h11_impl, "service_unavailable", check, params=("scope", "receive", "send"))
    require_source(name, h11_impl.H11Protocol.handle_events, ("app = service_unavailable",), check)
    h11_impl.service_unavailable = app


@functools.cache
def _head_deadline_base() -> type:
    """``H11Protocol`` plus the request-head deadline; built once, on first use (imports uvicorn)."""
    import h11
    from uvicorn.protocols.http import h11_impl
    from uvicorn.protocols.http.h11_impl import H11Protocol

    name = f"{__name__}.head_deadline_h11_protocol"
    check = ("H11Protocol's connection_made(transport), on_response_complete(), "
             "connection_lost(exc) and its loop, transport, cycle (response_complete) and conn "
             "(an h11.Connection with trailing_data) in uvicorn/protocols/http/h11_impl.py")
    require_attribute(name, H11Protocol, "connection_made", check, params=("self", "transport"))
    require_attribute(name, H11Protocol, "on_response_complete", check, params=("self",))
    require_attribute(name, H11Protocol, "connection_lost", check, params=("self", "exc"))
    require_source(name, H11Protocol.__init__, ("self.loop =", "self.transport", "self.cycle",
                                                 "self.conn = h11.Connection("), check)
    require_source(name, h11_impl.RequestResponseCycle.__init__, ("self.response_complete",), check)
    require_attribute(name, h11.Connection, "trailing_data", check)

    class HeadDeadlineH11Protocol(H11Protocol):
        """uvicorn's h11 protocol with a deadline for every request head: the request line and
        headers must arrive within ``head_timeout_s`` of the connection's start or of the
        previous response, else a partial head is answered ``head_timeout_response`` and the
        connection closed (an idle keep-alive connection is left to uvicorn's own keep-alive
        timeout)."""

        head_timeout_s = 30.0
        head_timeout_response = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _arm_head_deadline(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_expired)

        def _head_expired(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return  # the head arrived: the request is being served
            partial, _ = self.conn.trailing_data
            if partial:  # part of a request head and no more within the deadline
                self.transport.write(self.head_timeout_response)
            self.transport.close()

    return HeadDeadlineH11Protocol


def head_deadline_h11_protocol(head_timeout_s: float, expired_body: bytes,
                               content_type: bytes = b"application/json") -> type:
    """An ``http`` protocol class for uvicorn (``uvicorn.Config(http=...)``): uvicorn's
    ``H11Protocol`` plus a deadline of ``head_timeout_s`` for each request's line and headers,
    from the connection's start or the previous response. A partial head past it is answered
    ``408 Request Timeout`` with ``expired_body`` and the connection is closed.

    uvicorn alone waits forever for a request head that never finishes (a client that sent half
    its headers held its connection indefinitely) and has no setting for a head deadline; its
    keep-alive timeout only runs between requests. The class overrides ``connection_made``,
    ``on_response_complete`` and ``connection_lost`` and reads the protocol's ``loop``,
    ``transport``, ``cycle`` and ``conn`` (``h11.Connection.trailing_data``: the bytes of an
    unfinished head), all uvicorn internals, which are checked when the first class is built.
    """
    require_version(f"{__name__}.head_deadline_h11_protocol", "uvicorn", SUPPORTED,
                    "the hooks and attributes listed in head_deadline_h11_protocol's docstring")
    response = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: %s\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%s" % (content_type, len(expired_body), expired_body))
    return type("HeadDeadlineH11Protocol", (_head_deadline_base(),),
                {"head_timeout_s": float(head_timeout_s), "head_timeout_response": response})


__all__ = ["SUPPORTED", "answer_refused_requests_with", "head_deadline_h11_protocol"]
