"""A pool of environment servers behind one ``http`` environment: which server a new episode
goes to, and which servers are alive.

``HTTPEnv(base_urls=[...])`` asks :func:`pool_for` for the process-wide pool of those URLs
(shared by every episode of every iteration, so load counts and health state persist) and
:meth:`ServerPool.acquire` picks the live server with the fewest open instances, ties taken in
round-robin order. A server is marked down when a request to it fails at the transport level
(the client reports it) or when its health check fails; it is left out of new episodes until a
later check finds it healthy again. The episodes already on it fail with ``InfraError`` in the
client, as with one server: infra errors, never a reward of 0.

Health check: ``GET /health`` answering HTTP 200 (and ``"status": "ok"`` when it is a JSON
object, as this project's server answers); a server without ``/health`` (404: AgentGym's own
servers) counts as healthy when ``GET /`` answers 200. Checks run lazily in the thread that
acquires (no background thread to leak): a server is re-checked when its last check is older
than ``health_interval_s``, dead or alive; at most one thread checks a given server at a time.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from env_adapters.base import InfraError
from env_adapters.http_transport import new_client

log = logging.getLogger(__name__)


@dataclass
class _Server:
    url: str
    alive: bool = True  # optimistic until the first check: a dead one fails over at /create
    open: int = 0  # instances this process holds on it now (the load)
    episodes: int = 0  # instances ever opened on it
    failures: int = 0  # transport failures reported by clients, and failed checks
    checked_at: float = -math.inf
    checking: bool = False
    reason: str = ""  # why it is down


class ServerPool:
    """Servers of one environment; thread-safe (the rollout resets and steps from a thread pool)."""

    def __init__(self, urls: list[str], health_interval_s: float = 5.0, health_timeout_s: float = 2.0):
        urls = [u.rstrip("/") for u in urls]
        if not urls:
            raise ValueError("a server pool needs at least one URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"server URLs listed twice: {urls}")
        self.servers = [_Server(u) for u in urls]
        self.health_interval_s = float(health_interval_s)
        self.health_timeout_s = float(health_timeout_s)
        self._lock = threading.Lock()
        self._turn = itertools.count()

    # ------------------------------------------------------------ choosing a server

    def acquire(self, exclude: tuple[str, ...] | list[str] = ()) -> str:
        """The URL a new instance should be opened on (its load is counted until
        :meth:`release`). Raises ``InfraError`` naming every server when none is alive."""
        self._check_due()
        with self._lock:
            none_live = not self._live(exclude)
        if none_live:  # all down: check them now, not on state an interval old
            self._check_due(force=True)
        with self._lock:
            live = self._live(exclude)
            if not live:
                state = "; ".join(f"{s.url}: {s.reason or 'excluded'}" for s in self.servers)
                raise InfraError(f"no live environment server in the pool ({state})")
            n, start = len(self.servers), next(self._turn)
            best = min(live, key=lambda s: (s.open, (self.servers.index(s) - start) % n))
            best.open += 1
            best.episodes += 1
            return best.url

    def live_count(self, exclude: tuple[str, ...] | list[str] = ()) -> int:
        """How many servers not in ``exclude`` are believed alive now."""
        with self._lock:
            return len(self._live(exclude))

    def _live(self, exclude) -> list[_Server]:
        return [s for s in self.servers if s.alive and s.url not in exclude]

    def release(self, url: str) -> None:
        """An instance opened by :meth:`acquire` on ``url`` is closed (or was never opened)."""
        with self._lock:
            s = self._server(url)
            s.open = max(0, s.open - 1)

    def mark_down(self, url: str, why: str) -> None:
        """A client could not reach ``url``: no new episodes go there until a check passes."""
        with self._lock:
            s = self._server(url)
            s.failures += 1
            was_alive, s.alive, s.reason = s.alive, False, why
            s.checked_at = time.monotonic()  # the next check is one interval away
        if was_alive:
            log.warning("environment server %s is down (%s); new episodes go to the others", url, why)

    def snapshot(self) -> list[dict[str, Any]]:
        """Per server: url, alive, open, episodes, failures, reason (for logs and tests)."""
        with self._lock:
            return [{"url": s.url, "alive": s.alive, "open": s.open, "episodes": s.episodes,
                     "failures": s.failures, "reason": s.reason} for s in self.servers]

    # ------------------------------------------------------------ health

    def check(self, url: str) -> tuple[bool, str]:
        """``(healthy, why_not)`` of one server, by ``GET /health`` (else ``GET /``)."""
        try:
            with new_client(self.health_timeout_s) as client:
                r = client.get(f"{url}/health")
                if r.status_code == 404:  # an AgentGym server without /health: is it answering?
                    r = client.get(f"{url}/")
                    return (True, "") if r.status_code == 200 else (False, f"GET / answered HTTP {r.status_code}")
                if r.status_code != 200:
                    return False, f"GET /health answered HTTP {r.status_code}"
                try:
                    data = r.json()
                except ValueError:
                    return True, ""
                if isinstance(data, dict) and data.get("status", "ok") != "ok":
                    return False, f"GET /health says status {data.get('status')!r}"
                return True, ""
        except httpx.HTTPError as exc:
            return False, f"health check failed: {type(exc).__name__}: {exc}"

    def _check_due(self, force: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            due = [s for s in self.servers if not s.checking
                   and (force and not s.alive or now - s.checked_at >= self.health_interval_s)]
            for s in due:
                s.checking = True
        for s in due:
            ok, why = self.check(s.url)
            with self._lock:
                s.checking, s.checked_at = False, time.monotonic()
                came_back = ok and not s.alive
                went_down = not ok and s.alive
                s.alive, s.reason = ok, why
                if not ok:
                    s.failures += 1
            if came_back:
                log.warning("environment server %s is healthy again; back in rotation", s.url)
            elif went_down:
                log.warning("environment server %s failed its health check (%s)", s.url, why)

    def _server(self, url: str) -> _Server:
        for s in self.servers:
            if s.url == url:
                return s
        raise KeyError(url)


_POOLS: dict[tuple, ServerPool] = {}
_POOLS_LOCK = threading.Lock()


def pool_for(urls: list[str], health_interval_s: float = 5.0, health_timeout_s: float = 2.0) -> ServerPool:
    """The process-wide pool of ``urls`` (one per distinct list and settings)."""
    key = (tuple(u.rstrip("/") for u in urls), float(health_interval_s), float(health_timeout_s))
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = ServerPool(list(key[0]), health_interval_s, health_timeout_s)
        return _POOLS[key]


__all__ = ["ServerPool", "pool_for"]
