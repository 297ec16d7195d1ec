"""The HTTP clients of ``HTTPEnv`` and of the server pools' health checks, built cheaply.

Why: ``httpx.Client()`` loads the CA bundle into a fresh SSL context each time, tens of ms of CPU
per client against well under a millisecond for a client given an SSL context built once
(bench/README.md). An ``HTTPEnv`` (one per episode) built its own client, so that was most of an
episode's client-side CPU over loopback, where a whole step costs a few ms.

Why not one client for the whole process instead: httpcore's connection pool scans every
connection it holds, under one lock, on every request (``_assign_requests_to_connections``,
each idle connection polled with ``select``), so with 64 episodes on one shared client each
request cost O(64) and the env threads queued on the pool's lock (profiled: 46 % of client
samples in that lock). A client per episode keeps its one connection, as before: O(1) per
request, and ``HTTPEnv.close`` still closes the episode's connection.

The SSL context is the one httpx builds by default (``httpx.create_ssl_context()``: certifi,
or ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` where set), made once per process on first use.
"""

from __future__ import annotations

import ssl
import threading

import httpx

_lock = threading.Lock()
_context: ssl.SSLContext | None = None


def ssl_context() -> ssl.SSLContext:
    """The process's default-verifying SSL context (built on first use)."""
    global _context
    if _context is None:
        with _lock:
            if _context is None:
                _context = httpx.create_ssl_context()
    return _context


def new_client(timeout_s: float) -> httpx.Client:
    """An ``httpx.Client`` with ``timeout_s`` per phase (connecting within at most 10 s), as
    ``httpx.Client(timeout=...)`` builds it, but sharing the process's SSL context."""
    return httpx.Client(timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
                        verify=ssl_context())


__all__ = ["new_client", "ssl_context"]
