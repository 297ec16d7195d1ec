"""The environment server under load and abuse: 64 clients playing episodes at once; bodies of
10 MB, malformed and absurdly nested JSON, unknown instance ids; slowloris clients that send a
head or a body slowly or never finish it; a client that never closes its instances. Each abuse
gets a clear answer (HTTP 413 / 408 for transport abuse; the protocol's error payload, never a
500, for protocol abuse) within the request timeout, while a well-behaved client keeps playing
episodes beside it without an error. The server listens on loopback unless told otherwise."""

from __future__ import annotations

import inspect
import json
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from env_adapters.base import InfraError
from env_adapters.http_client import HTTPEnv
from env_adapters.http_server import create_app, serve, uvicorn_options

sys.path.insert(0, str(Path(__file__).parents[1] / "env_adapters"))
from serving import ServerThread  # noqa: E402

pytestmark = pytest.mark.timeout(600)  # a hang guard with room for 64 clients on a heavily loaded machine
TIMEOUT_S = 1.0  # the server's request_timeout_s in these tests (default 30 s)


@pytest.fixture
def server(request):
    """The keyword environment served with the limits ``serve`` applies (short timeout)."""
    kw = getattr(request, "param", {})
    app = create_app("keyword", request_timeout_s=TIMEOUT_S, **{"max_envs": 80, **kw})
    st = ServerThread(app, **uvicorn_options(request_timeout_s=TIMEOUT_S, max_connections=256))
    yield st
    st.stop()


def episode(url: str, task: int) -> tuple[float, int]:
    """One well-behaved episode over HTTP: an unreadable reply (a format error, the episode goes
    on), then the right word. Returns (reward, turns)."""
    env = HTTPEnv(url, "keyword", timeout_s=60, retries=2, backoff_s=0.05)  # slow is not an error here
    try:
        env.reset(task)
        first = env.step("???")
        assert first.info.get("format_error") and not first.terminated, first
        last = env.step("yes")
        assert last.terminated, last
        return last.reward, 2
    finally:
        env.close()


def raw(port: int, data: bytes, *, then: bytes = b"", drip_s: float = 0.0, wait_s: float = 30.0) -> tuple[int | None, dict, float]:
    """Send ``data`` on a raw connection, then ``then`` one byte every ``drip_s`` seconds (a
    slowloris); returns (HTTP status or None when closed without one, JSON body, seconds until
    the server answered or closed)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(wait_s)
    t0 = time.monotonic()
    try:
        s.sendall(data)
        for b in then:
            time.sleep(drip_s)
            try:
                s.sendall(bytes([b]))
            except OSError:
                break  # the server gave up on us: read its answer
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    finally:
        s.close()
    if not got:
        return None, {}, time.monotonic() - t0
    head, _, body = got.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body or b"{}"), time.monotonic() - t0


class GoodClient(threading.Thread):
    """Plays episodes in a loop until stopped, recording errors and the slowest episode."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop, self.errors, self.episodes, self.slowest = url, threading.Event(), [], 0, 0.0

    def run(self):
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                assert episode(self.url, self.episodes % 5) == (1.0, 2)
                self.episodes += 1
            except Exception as e:  # noqa: BLE001 - recorded, asserted by the test
                self.errors.append(repr(e))
            self.slowest = max(self.slowest, time.monotonic() - t0)


def test_64_clients_play_episodes_at_once(server):
    barrier = threading.Barrier(64)

    def play(i: int):
        barrier.wait(timeout=120)  # all 64 start together
        return episode(server.url, i)

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(play, range(64)))
    assert results == [(1.0, 2)] * 64
    health = httpx.get(f"{server.url}/health").json()
    assert health["envs"] == 0, health  # every instance closed


def test_abuse_is_answered_and_good_clients_are_served_meanwhile(server):
    url, port = server.url, server.port
    good = GoodClient(url)
    good.start()
    try:
        # 10 MB: refused from its Content-Length before the bytes are read ...
        status, body, took = raw(port, b"POST /step HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                       b"Content-Length: 10000000\r\n\r\n" + b'{"id": 0, "action": "' + b"y" * 1000)
        assert (status, body["code"]) == (413, "too_large") and "max_body_bytes=1048576" in body["error"]
        # ... and a real 10 MB upload from an ordinary client gets the same answer or a refused write
        try:
            r = httpx.post(f"{url}/step", content=b"x" * 10_000_000, timeout=10)
            assert r.status_code == 413 and r.json()["code"] == "too_large"
        except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
            pass  # the server closed the connection while the client was still sending
        # ... and without a Content-Length (chunked), refused once the bytes read pass the limit
        big = b"z" * ((1 << 20) + 1)
        status, body, _ = raw(port, b"POST /step HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                                    + b"%x\r\n" % len(big) + big + b"\r\n0\r\n\r\n")
        assert (status, body["code"]) == (413, "too_large")

        # protocol abuse: the AgentGym error payload (HTTP 200), never a 500
        for route, payload, code in [
            ("/step", b"{not json", "bad_request"),
            ("/step", b"[" * 100_000 + b"]" * 100_000, "bad_request"),  # deeper than Python's stack
            ("/reset", b'"just a string"', "bad_request"),
            ("/step", b'{"id": 987654, "action": "yes"}', "unknown_id"),
            ("/reset", b'{"id": 987654}', "unknown_id"),
            ("/close", b'{"id": -1}', "unknown_id"),
        ]:
            r = httpx.post(f"{url}{route}", content=payload, timeout=5)
            assert r.status_code == 200 and r.json()["code"] == code, (route, payload[:20], r.text[:200])
        r = httpx.get(f"{url}/observation", params={"id": 987654}, timeout=5)
        assert r.json()["code"] == "unknown_id"
        # a request that names no instance (or two) is an HTTP 400 that changes nothing
        for route, payload in [("/reset", b'{"id": "zero"}'), ("/step", b'{"action": "yes"}'),
                               ("/step", b'{"id": 1, "env_idx": 2, "action": "yes"}')]:
            r = httpx.post(f"{url}{route}", content=payload, timeout=5)
            assert r.status_code == 400 and r.json()["code"] == "bad_request", (route, payload, r.text[:200])
        assert httpx.get(f"{url}/observation", params={"id": "x"}, timeout=5).status_code == 400

        # slowloris: 40 connections holding half a request head, and one dripping a body
        heads = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
        for s in heads:
            s.sendall(b"POST /step HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        status, body, took = raw(port, b"POST /step HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n{",
                                 then=b'"id": 0, "action": "yes"}', drip_s=0.3)
        assert (status, body["code"]) == (408, "timeout") and "body" in body["error"], body
        assert TIMEOUT_S - 0.2 < took < TIMEOUT_S + 20, took  # the deadline, not a hang (loaded machines lag)
        # a head that never finishes: 408 and closed; a connection that says nothing: closed
        status, body, took = raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\n", then=b"X-A: b\r\n", drip_s=0.4)
        assert (status, body.get("code")) == (408, "timeout") and "head" in body["error"], body
        assert took < TIMEOUT_S + 20, took
        status, _, took = raw(port, b"")
        assert status is None and took < TIMEOUT_S + 20, took
        for s in heads:  # the 40 stalled heads were answered 408 and closed too
            s.settimeout(30)
            assert s.recv(100).startswith(b"HTTP/1.1 408")
            s.close()
    finally:
        good.stop.set()
        good.join(timeout=30)
    assert good.errors == [] and good.episodes >= 3, (good.errors[:3], good.episodes)
    assert good.slowest < 30, good.slowest  # never stuck behind the abuse (a hang would be forever)
    assert httpx.get(f"{url}/health", timeout=5).json()["status"] == "ok"


@pytest.mark.parametrize("server", [{"max_envs": 8, "idle_timeout_s": 5, "reap_interval_s": 0.2}], indirect=True)
def test_a_client_that_never_closes_its_instances_is_reaped(server):
    url = server.url

    def create(_=None) -> dict:
        return httpx.post(f"{url}/create", json={}, timeout=30).json()

    with ThreadPoolExecutor(8) as pool:  # all at once: well inside the idle timeout
        leaked = [r["id"] for r in pool.map(create, range(8))]
    assert len(set(leaked)) == 8  # and never closed
    refused = create()
    assert refused["code"] == "capacity", refused
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/health", timeout=5).json()["reaped"] < 8:
        assert time.monotonic() < deadline, "idle instances were never reaped"
        time.sleep(0.1)
    assert episode(url, 1) == (1.0, 2)  # room again for a well-behaved client
    r = httpx.post(f"{url}/step", json={"id": leaked[0], "action": "yes"}, timeout=5).json()
    assert r["code"] == "unknown_id" and "reaped" in r["error"]


def test_the_server_listens_on_loopback_unless_told_otherwise():
    from agentgym_cli.cli import env_serve

    assert inspect.signature(serve).parameters["host"].default == "127.0.0.1"
    assert inspect.signature(env_serve).parameters["host"].default.default == "127.0.0.1"


def test_beyond_max_connections_a_client_gets_503_busy_and_the_server_recovers():
    """``max_connections=4``: with 3 connections held open, a request (its own connection the
    4th) is answered 503 with the ``busy`` payload naming the limit; once they close, clients are
    served again, and a client that retries (``HTTPEnv``'s backoff) gets through by itself."""
    limit, hold_s = 4, 30.0  # a long request timeout: the held connections are not closed by it
    app = create_app("keyword", request_timeout_s=hold_s, max_envs=8)
    st = ServerThread(app, **uvicorn_options(request_timeout_s=hold_s, max_connections=limit))
    ask = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    held: list[socket.socket] = []
    try:
        held = [socket.create_connection(("127.0.0.1", st.port)) for _ in range(limit - 2)]
        status, body, _ = raw(st.port, ask)
        assert status == 200 and body["status"] == "ok", body  # its own connection is the limit - 1th
        held.append(socket.create_connection(("127.0.0.1", st.port)))
        time.sleep(0.3)  # the server has accepted it (loopback; generous on a loaded machine)

        status, body, took = raw(st.port, ask)
        assert status == 503 and body["code"] == "busy" and "max_connections" in body["error"], (status, body)
        assert took < 10, took  # answered at once, and the connection closed
        impatient = HTTPEnv(st.url, "keyword", timeout_s=10, retries=1, backoff_s=0.05)
        with pytest.raises(InfraError, match="HTTP 503.*max_connections"):  # what a client reports
            impatient.reset(0)
        impatient.close()

        # a client that retries (0.1 s, 0.2 s, ... 3.1 s in all) gets through once connections close
        threading.Timer(0.5, lambda: [s.close() for s in held]).start()
        patient = HTTPEnv(st.url, "keyword", timeout_s=10, retries=5, backoff_s=0.1)
        try:
            patient.reset(3)
            assert patient.step("yes").reward == 1.0
        finally:
            patient.close()
        status, body, _ = raw(st.port, ask)
        assert status == 200 and body["status"] == "ok", body
        assert httpx.get(f"{st.url}/health", timeout=5).json()["envs"] == 0
    finally:
        for s in held:
            s.close()
        st.stop()
