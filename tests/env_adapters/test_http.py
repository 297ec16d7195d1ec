"""The AgentGym HTTP protocol: ``env_adapters.http_server`` and ``env_adapters.http_client``.

Every server here runs in a background thread on 127.0.0.1 (a free port) and is stopped by its
fixture. The environment under test is ``CounterEnv`` below, registered in
``env_adapters.ADAPTERS`` by monkeypatching, so these tests depend on no other adapter.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from typing import Any

import httpx
import pytest

import env_adapters
from env_adapters.base import InfraError, StepResult, TextEnv, format_error
from env_adapters.http_client import HTTPEnv
from env_adapters.http_server import create_app

pytestmark = pytest.mark.timeout(60)

# uvicorn and fastapi are required dependencies (pyproject.toml): missing is a failure, no skip
import uvicorn  # noqa: E402
from fastapi import APIRouter, FastAPI, Request  # noqa: E402
from fastapi.responses import PlainTextResponse  # noqa: E402


# ------------------------------------------------------------------------- the test env


class CounterEnv(TextEnv):
    """Deterministic: reply ``add N``; the episode ends when the count reaches the target."""

    name = "counter"
    closed_count = 0
    in_flight = 0  # steps running right now, over every instance of the process
    peak = 0  # the most steps seen running at once (reset it before measuring)
    _class_lock = threading.Lock()

    def __init__(self, target: int = 3, sleep_s: float = 0.0):
        self.target = target
        self.sleep_s = sleep_s
        self.goal = target
        self.count = 0
        self._closed = False

    def system_prompt(self) -> str:
        return "Reply with 'add N' to add N to the counter."

    def valid_actions(self) -> list[str] | None:
        return ["add 1", "add 2"]

    def reset(self, task_id: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
        self.goal = self.target + task_id + seed % 2
        self.count = 0
        return f"Task {task_id}: reach {self.goal}. count=0", {"goal": self.goal, "pair": (1, 2)}

    def step(self, action_text: str) -> StepResult:
        if self.sleep_s:
            with CounterEnv._class_lock:
                CounterEnv.in_flight += 1
                CounterEnv.peak = max(CounterEnv.peak, CounterEnv.in_flight)
            try:
                time.sleep(self.sleep_s)
            finally:
                with CounterEnv._class_lock:
                    CounterEnv.in_flight -= 1
        if "crash" in action_text:
            raise RuntimeError("simulated simulator crash")
        m = re.fullmatch(r"\s*add\s+(-?\d+)\s*", action_text)
        if not m:
            return format_error(f"Unparseable reply. Reply 'add N'. count={self.count}",
                                parsed_action=None)
        self.count += int(m.group(1))
        done = self.count >= self.goal
        return StepResult(f"count={self.count}", 1.0 if done else 0.0, done, False,
                          {"parsed_action": m.group(0).strip(), "format_error": False,
                           "count": self.count, "nan": float("nan")})

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with CounterEnv._class_lock:
                CounterEnv.closed_count += 1


@pytest.fixture
def counter_registered(monkeypatch):
    monkeypatch.setitem(env_adapters.ADAPTERS, "counter", f"{__name__}:CounterEnv")
    yield "counter"


# ------------------------------------------------------------------------- server threads

from serving import ServerThread  # noqa: E402



@pytest.fixture
def start_server():
    started: list[ServerThread] = []

    def start(app) -> ServerThread:
        st = ServerThread(app)
        started.append(st)
        return st

    yield start
    for st in started:
        if st.thread.is_alive():
            st.stop()


def fast_env(url: str, name: str = "counter", **kw) -> HTTPEnv:
    kw.setdefault("timeout_s", 5)
    kw.setdefault("retries", 2)
    kw.setdefault("backoff_s", 0.05)
    return HTTPEnv(url, name, **kw)


# ------------------------------------------------------------------------- tests


def test_health_and_root(counter_registered, start_server):
    srv = start_server(create_app("counter", max_envs=5))
    r = httpx.get(f"{srv.url}/health")
    assert r.status_code == 200
    h = r.json()
    assert h["status"] == "ok" and h["env"] == "counter" and h["envs"] == 0 and h["max_envs"] == 5
    assert httpx.get(srv.url + "/").json() == "This is environment counter."
    env = fast_env(srv.url)
    env.reset(0)
    assert env.health()["envs"] == 1
    env.close()
    assert httpx.get(f"{srv.url}/health").json()["envs"] == 0


def test_unknown_env_name_rejected():
    with pytest.raises(ValueError, match="unknown environment"):
        create_app("no-such-env")


def test_reset_brings_the_system_prompt_so_the_client_asks_no_more(counter_registered, start_server):
    """/reset carries the instance's system prompt (what GET /system_prompt?id= answers), and
    HTTPEnv uses it: an episode's prompt costs no request of its own; a prompt given to the
    client still wins."""
    srv = start_server(create_app("counter"))
    created = httpx.post(f"{srv.url}/create", json={}).json()
    reset = httpx.post(f"{srv.url}/reset", json={"id": created["id"], "data_idx": 0}).json()
    asked = httpx.get(f"{srv.url}/system_prompt", params={"id": created["id"]}).json()
    assert reset["system_prompt"] == asked == CounterEnv().system_prompt()

    remote = fast_env(srv.url)
    try:
        remote.reset(0)
        real, remote._request = remote._request, None  # any request now fails the test
        assert remote.system_prompt() == CounterEnv().system_prompt()
        remote._request = real
    finally:
        remote.close()
    own = fast_env(srv.url, system_prompt="mine")
    try:
        own.reset(0)
        assert own.system_prompt() == "mine"
    finally:
        own.close()


@pytest.mark.timeout(180)  # a hang guard with room for a loaded machine
def test_round_trip_matches_in_process(counter_registered, start_server):
    srv = start_server(create_app("counter"))
    actions = ["add 1", "oops not an action", "add 1", "add 5"]
    local = CounterEnv()
    remote = fast_env(srv.url)
    for task_id, seed in [(0, 0), (2, 1)]:
        lo, linfo = local.reset(task_id, seed)
        ro, rinfo = remote.reset(task_id, seed)
        assert ro == lo
        assert rinfo["goal"] == linfo["goal"] and rinfo["pair"] == [1, 2]
        assert rinfo["task_id"] == task_id and rinfo["seed"] == seed
        for a in actions:
            ls, rs = local.step(a), remote.step(a)
            assert (rs.observation, rs.reward, rs.terminated, rs.truncated) == \
                   (ls.observation, ls.reward, ls.terminated, ls.truncated)
            assert rs.info["format_error"] == ls.info["format_error"]
            assert rs.info.get("parsed_action") == ls.info.get("parsed_action")
            assert isinstance(rs.reward, float) and 0.0 <= rs.reward <= 1.0
            if "nan" in ls.info:
                assert rs.info["nan"] is None  # NaN is not JSON: sent as null
            if ls.terminated:
                break
        assert remote.observe() == ls.observation
    assert remote.system_prompt() == local.system_prompt()
    assert remote.valid_actions() == local.valid_actions()

    # every step of an episode goes over the one kept-alive connection: a new connection (or
    # TCP handshake) per step is what made steps slow before; the latency itself is a bench/
    # figure (bench/env_concurrency.py), not a test's
    import socket as socket_module

    opened = []
    real = socket_module.create_connection

    def counting(*args, **kwargs):
        opened.append(args[0] if args else kwargs.get("address"))
        return real(*args, **kwargs)

    remote.reset(0)
    remote.step("add 0")  # the connection exists now
    socket_module.create_connection = counting
    try:
        for _ in range(50):
            remote.step("add 0")
        remote.reset(1)
    finally:
        socket_module.create_connection = real
    assert opened == []
    remote.close()


def test_error_payload_is_infra_error_not_reward(counter_registered, start_server):
    srv = start_server(create_app("counter"))
    env = fast_env(srv.url)
    env.reset(0)
    with pytest.raises(InfraError, match="simulated simulator crash") as ei:
        env.step("crash please")
    assert srv.url in str(ei.value)
    # the raw protocol: HTTP 200 with {"error": ...}
    r = httpx.post(f"{srv.url}/step", json={"id": 999, "action": "add 1"})
    assert r.status_code == 200 and r.json()["code"] == "unknown_id" and "error" in r.json()
    r = httpx.post(f"{srv.url}/step", json={"action": "add 1"})  # names no instance: HTTP 400
    assert r.status_code == 400 and r.json()["code"] == "bad_request"
    r = httpx.post(f"{srv.url}/reset", content=b"{not json")
    assert r.status_code == 200 and r.json()["code"] == "bad_request"
    # a task id that is not an integer is refused, never replaced by the default task
    created = httpx.post(f"{srv.url}/create", json={}).json()
    for bad in ("abc", 1.5, [3], True):
        r = httpx.post(f"{srv.url}/reset", json={"id": created["id"], "data_idx": bad})
        assert r.json()["code"] == "bad_request" and "data_idx" in r.json()["error"], bad
    # a client whose instance the server does not know
    ghost = fast_env(srv.url)
    ghost.env_id = 12345
    with pytest.raises(InfraError, match="unknown environment id"):
        ghost.step("add 1")
    # a step before reset is refused by the server, as an error payload
    r = httpx.post(f"{srv.url}/create")
    env_id = r.json()["id"]
    r = httpx.post(f"{srv.url}/step", json={"id": env_id, "action": "add 1"})
    assert "step before reset" in r.json()["error"]
    env.close()
    env.close()  # idempotent


def test_server_killed_mid_episode_raises_infra_error_quickly(counter_registered, start_server, monkeypatch):
    """Counted, not timed: a refused connection is an attempt that fails at once, so "quickly"
    means a bounded number of attempts with the backoff's sleeps between them, and no other wait."""
    import env_adapters.http_client as http_client

    srv = start_server(create_app("counter"))
    env = fast_env(srv.url, timeout_s=2, retries=2, backoff_s=0.05)
    env.reset(0)
    assert env.step("add 1").reward == 0.0
    srv.stop()
    sleeps: list[float] = []
    monkeypatch.setattr(http_client.time, "sleep", sleeps.append)
    with pytest.raises(InfraError) as ei:
        env.step("add 1")
    msg = str(ei.value)
    assert srv.url in msg and "3 attempt" in msg and "ConnectError" in msg
    assert sleeps == [0.05, 0.1]  # backoff_s * 2**k between the 3 attempts, nothing else
    sleeps.clear()
    with pytest.raises(InfraError, match="3 attempt"):
        env.reset(1)
    assert sleeps == [0.05, 0.1]
    env.close()  # never raises, even with the server gone


def test_refused_connections_are_retried_with_backoff_until_the_server_is_up(
        counter_registered, monkeypatch):
    """The server is down for the first attempts (its port is bound but not yet listening, so
    connections are refused) and comes up 0.3 s later: ``reset`` (``/create``, then ``/reset``)
    succeeds after retrying, with ``backoff_s * 2**k`` sleeps in between. ``/create`` is not
    idempotent, but a refused connection never reached the server, so it is retried."""
    import types

    import env_adapters.http_client as http_client

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # reserved, not listening: connect() is refused
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app("counter"), log_level="warning",
                                           lifespan="on", timeout_graceful_shutdown=2))
    up_at: list[float] = []

    def start_late() -> None:
        time.sleep(0.3)
        up_at.append(time.monotonic())
        server.run(sockets=[sock])  # uvicorn listen()s on it now

    sleeps: list[float] = []

    def recording_sleep(seconds: float) -> None:
        sleeps.append(seconds)
        time.sleep(seconds)

    monkeypatch.setattr(http_client, "time", types.SimpleNamespace(sleep=recording_sleep))
    env = HTTPEnv(url, "counter", timeout_s=5, retries=6, backoff_s=0.1)
    calls: list[tuple[str, float]] = []
    send = env._client.request

    def counting_request(method, request_url, **kw):
        calls.append((str(request_url).rsplit("/", 1)[-1], time.monotonic()))
        return send(method, request_url, **kw)

    env._client.request = counting_request
    thread = threading.Thread(target=start_late, daemon=True)
    t0 = time.monotonic()
    thread.start()
    try:
        obs, info = env.reset(2)
        elapsed = time.monotonic() - t0
        assert obs == "Task 2: reach 5. count=0" and info["env_id"] is not None
        assert env.step("add 5").terminated
        creates = [t for route, t in calls if route == "create"]
        assert [route for route, _ in calls] == ["create"] * len(creates) + ["reset", "step"]
        assert len(creates) >= 2  # the first attempt, at t=0, was refused
        assert len(sleeps) == len(creates) - 1  # one backoff before every retry
        assert sleeps == pytest.approx([0.1 * 2 ** k for k in range(len(sleeps))])
        assert creates[-1] >= up_at[0]  # the attempt that got through came after the server
        assert elapsed >= sum(sleeps)
        print(f"\n[http] server up after 0.3 s: {len(creates)} /create attempts, "
              f"backoff {sleeps}, reset done in {elapsed:.2f} s")
    finally:
        env.close()
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
    assert not thread.is_alive()


def test_unresponsive_server_times_out_not_hangs(monkeypatch):
    """A server that accepts connections and never answers: each attempt ends at the read
    timeout (httpx's ReadTimeout, not a hang), a step is not resent, a reset is retried with the
    backoff's sleeps. Counted, not timed (pytest-timeout would catch a hang)."""
    import env_adapters.http_client as http_client

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)  # the kernel completes the handshake; nobody ever reads
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sleeps: list[float] = []
    try:
        env = HTTPEnv(url, "counter", timeout_s=0.5, retries=2, backoff_s=0.05)
        monkeypatch.setattr(http_client.time, "sleep", sleeps.append)
        env.env_id = 0  # pretend an episode is running
        with pytest.raises(InfraError, match="ReadTimeout.*not retried"):
            env.step("add 1")  # may have been applied: one attempt only
        assert sleeps == []
        with pytest.raises(InfraError, match="3 attempt.*ReadTimeout"):
            env.reset(0)  # reset is idempotent: retried, then given up
        assert sleeps == [0.05, 0.1]
        env.close()
    finally:
        sock.close()


def test_max_envs_limit(counter_registered, start_server):
    srv = start_server(create_app("counter", max_envs=2))
    a, b, c = fast_env(srv.url), fast_env(srv.url), fast_env(srv.url)
    a.reset(0)
    b.reset(0)
    with pytest.raises(InfraError, match="max_envs=2"):
        c.reset(0)
    a.close()
    obs, _ = c.reset(0)
    assert obs.startswith("Task 0")
    assert httpx.get(f"{srv.url}/health").json()["envs"] == 2
    b.close()
    c.close()


def test_idle_reaping_closes_envs(counter_registered, start_server):
    # idle_timeout_s (3 s) is far above a step's latency on a loaded machine, so the busy env never
    # looks idle; the idle one is waited for by polling with a generous deadline, not a fixed
    # sleep; /health goes through a client made beforehand (making one can stall on a loaded
    # machine). Shorter idle timeouts, a fixed wait and a client made late all failed under load.
    app = create_app("counter", idle_timeout_s=3.0, reap_interval_s=0.05)
    srv = start_server(app)
    before = CounterEnv.closed_count
    busy, idle = fast_env(srv.url), fast_env(srv.url)
    probe = httpx.Client(base_url=srv.url, timeout=10)
    busy.reset(0)
    idle.reset(0)
    t0 = time.monotonic()
    while app.state.pool.reaped == 0:  # keep one env in use, leave the other alone
        assert time.monotonic() - t0 < 60, "the idle env was never reaped"
        busy.step("add 0")
        time.sleep(0.05)
    health = probe.get("/health").json()
    probe.close()
    assert health["envs"] == 1 and health["reaped"] == 1, health
    assert busy.step("add 0").observation == "count=0"  # the busy one is still there
    assert CounterEnv.closed_count - before == 1
    with pytest.raises(InfraError, match="unknown environment id"):
        idle.step("add 1")
    # a reset after the server forgot the instance creates a fresh one
    obs, info = idle.reset(1)
    assert obs.startswith("Task 1") and idle.step("add 1").observation == "count=1"
    busy.close()
    idle.close()
    srv.stop()  # shutdown closes what is left
    assert app.state.pool.reaped >= 1 and len(app.state.pool) == 0


def test_concurrent_steps_run_in_parallel(counter_registered, start_server):
    # steps of 0.5 s: all 8 reach the adapter within that even on a loaded machine
    srv = start_server(create_app("counter", env_kwargs={"sleep_s": 0.5}))
    n = 8
    envs = [fast_env(srv.url) for _ in range(n)]
    for e in envs:
        e.reset(0)
        e.step("add 0")  # warm the connections

    def run_all(targets: list[HTTPEnv]) -> None:
        barrier = threading.Barrier(len(targets))
        errors: list[BaseException] = []

        def worker(e: HTTPEnv) -> None:
            barrier.wait()
            try:
                res = e.step("add 0")
                assert res.observation == "count=0"
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(e,)) for e in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert not errors, errors

    # counted, not timed: the steps of n instances are inside the adapter at the same time, and
    # the per-instance lock lets one step of an instance in at a time
    CounterEnv.peak = 0
    run_all(envs)
    assert CounterEnv.peak == n
    CounterEnv.peak = 0
    run_all([envs[0]] * 4)
    assert CounterEnv.peak == 1
    for e in envs:
        e.close()


def test_client_validation_and_closed_env():
    with pytest.raises(ValueError, match="unknown dialect"):
        HTTPEnv("http://127.0.0.1:1", "x", dialect="nope")
    env = HTTPEnv("http://127.0.0.1:1", "x")
    with pytest.raises(InfraError, match="before reset"):
        env.step("add 1")
    env.close()
    with pytest.raises(InfraError, match="closed"):
        env.reset(0)


# ------------------------------------------------------------------------- real-server dialects


def make_fake_agentgym_servers():
    """Routes shaped like the real AgentGym servers (textcraft, babyai, sciworld, searchqa,
    webarena), one per URL prefix; each records the JSON bodies it got."""
    app = FastAPI()
    seen: dict[str, list[tuple[str, Any]]] = {}

    def rec(name: str, route: str, body: Any) -> None:
        seen.setdefault(name, []).append((route, body))

    async def recorded(request: Request, name: str, route: str) -> Any:
        """The request's JSON body (None if empty), recorded as ``(route, body)`` under ``name``."""
        raw = await request.body()
        import json
        b = json.loads(raw) if raw else None
        rec(name, route, b)
        return b

    tc = APIRouter(prefix="/textcraft")

    @tc.post("/create")
    async def tc_create(request: Request):
        await recorded(request, "textcraft", "create")
        return {"id": 0, "observation": "Crafting commands: ...", "done": False, "reward": 0}

    @tc.post("/reset")
    async def tc_reset(request: Request):
        b = await recorded(request, "textcraft", "reset")
        return {"id": b["id"], "observation": f"Goal: craft item {b['data_idx']}.",
                "done": False, "reward": 0}

    @tc.post("/step")
    async def tc_step(request: Request):
        b = await recorded(request, "textcraft", "step")
        ok = b["action"] == "craft 1 stick using 2 planks"
        return {"observation": f"Did: {b['action']}", "reward": 1 if ok else 0, "done": ok}

    ba = APIRouter(prefix="/babyai")

    @ba.post("/create")
    async def ba_create(request: Request):
        await recorded(request, "babyai", "create")
        return {"id": 4}

    @ba.post("/reset")
    async def ba_reset(request: Request):
        await recorded(request, "babyai", "reset")
        return {"observation": "Your goal: go to the red ball", "reward": 0, "score": 0,
                "deleted": False, "done": False}

    @ba.post("/step")
    async def ba_step(request: Request):
        b = await recorded(request, "babyai", "step")
        ok = b["action"] == "go to red ball 1"
        return {"observation": "You see a ball.", "reward": 0.9 if ok else 0,
                "score": 1.9 if ok else 0, "done": ok}

    sw = APIRouter(prefix="/sciworld")
    sw_scores = iter([50, 100, -100])

    @sw.post("/create")
    async def sw_create(request: Request):
        await recorded(request, "sciworld", "create")
        return {"id": 2}

    @sw.post("/reset")
    async def sw_reset(request: Request):
        await recorded(request, "sciworld", "reset")
        return {"task_name": "boil", "var_num": 0, "task_description": "Your task is to boil water.",
                "observation": "This room is called the kitchen.", "reward": 0, "score": 0,
                "deleted": False, "done": False}

    @sw.post("/step")
    async def sw_step(request: Request):
        await recorded(request, "sciworld", "step")
        score = next(sw_scores)
        return {"observation": "ok", "reward": 25, "score": score, "done": score in (100, -100)}

    ds = APIRouter(prefix="/deepsearch")

    @ds.post("/create")
    async def ds_create(request: Request):
        await recorded(request, "deepsearch", "create")
        return 7

    @ds.post("/reset")
    async def ds_reset(request: Request):
        b = await recorded(request, "deepsearch", "reset")
        return f"Question {b['id']}: who?"

    @ds.post("/step")
    async def ds_step(request: Request):
        b = await recorded(request, "deepsearch", "step")
        ok = "<answer>" in b["action"]
        return {"observation": "Congratulations!" if ok else "<information>doc</information>",
                "reward": 1.0 if ok else 0.0, "done": ok, "info": None}

    @ds.get("/observation")
    async def ds_obs(env_idx: int):
        rec("deepsearch", "observation", {"env_idx": env_idx})
        return "Question: who?"

    @ds.post("/close")
    async def ds_close(request: Request):
        await recorded(request, "deepsearch", "close")
        return True

    wa = APIRouter(prefix="/webarena")

    @wa.post("/create")
    async def wa_create(request: Request):
        await recorded(request, "webarena", "create")
        return {"env_idx": 3}

    @wa.post("/reset")
    async def wa_reset(request: Request):
        b = await recorded(request, "webarena", "reset")
        return {"observation": f"Tab 0: page for config {b['idx']}"}

    @wa.post("/step")
    async def wa_step(request: Request):
        b = await recorded(request, "webarena", "step")
        stop = "stop [" in b["action"]
        return {"observation": "page", "reward": 1.0 if stop else 0.0, "terminated": stop,
                "truncated": False, "info": {"page": "x"}}

    @wa.post("/close")
    async def wa_close(request: Request):
        await recorded(request, "webarena", "close")
        return PlainTextResponse("closed")

    for r in (tc, ba, sw, ds, wa):
        app.include_router(r)
    return app, seen


def test_dialects_match_real_agentgym_servers(start_server):
    app, seen = make_fake_agentgym_servers()
    srv = start_server(app)

    # TextCraft: {id, data_idx}; the action is extracted from "Action:" client side
    env = fast_env(f"{srv.url}/textcraft", "textcraft", dialect="textcraft")
    obs, _ = env.reset(5)
    assert obs == "Goal: craft item 5."
    two = env.step("Action: get 1 stick\nAction: get 2 planks")
    assert two.info["format_error"] and two.reward == 0.0 and not two.terminated
    res = env.step("Thought:\nI have planks.\n\nAction:\ncraft 1 stick using 2 planks!")
    assert res.reward == 1.0 and res.terminated and res.info["parsed_action"] == \
        "craft 1 stick using 2 planks"
    env.close()  # the real TextCraft server has no /close: a 404 is fine
    assert [r for r, _ in seen["textcraft"]] == ["create", "reset", "step"]
    assert seen["textcraft"][0][1] == {"commands": None, "goal": None}
    assert seen["textcraft"][1][1] == {"id": 0, "data_idx": 5}
    assert seen["textcraft"][2][1] == {"id": 0, "action": "craft 1 stick using 2 planks"}

    # BabyAI: no body on /create; "reward" (not the running "score") is the step reward
    env = fast_env(f"{srv.url}/babyai", "babyai", dialect="babyai")
    assert env.reset(3)[0] == "Your goal: go to the red ball"
    res = env.step("Thought: it is near.\nAction: go to red ball 1</s>")
    assert res.reward == pytest.approx(0.9) and res.terminated and res.info["score"] == 1.9
    env.close()
    assert seen["babyai"][0][1] is None
    assert seen["babyai"][1][1] == {"id": 4, "data_idx": 3}
    assert seen["babyai"][2][1] == {"id": 4, "action": "go to red ball 1"}

    # SciWorld: task description prepended; score / 100, clipped to [0, 1]
    env = fast_env(f"{srv.url}/sciworld", "sciworld", dialect="sciworld")
    obs, info = env.reset(11)
    assert obs == "Your task is to boil water.\nThis room is called the kitchen."
    assert info["task_name"] == "boil"
    rewards = [env.step("Action: look around") for _ in range(2)]
    assert [r.reward for r in rewards] == [0.5, 1.0] and rewards[1].terminated
    assert rewards[0].info["reward_is_cumulative"] is True
    env.reset(11)
    failed = env.step("Action: eat water")
    assert failed.reward == 0.0 and failed.terminated  # score -100 -> 0
    assert seen["sciworld"][1][1] == {"id": 2, "data_idx": 11}
    assert seen["sciworld"][2][1] == {"id": 2, "action": "look around"}
    env.close()

    # Deep search (Search-R1 style): env_idx everywhere, bare int / bare string replies
    env = fast_env(f"{srv.url}/deepsearch", "deepsearch", dialect="deepsearch")
    obs, info = env.reset(42)
    assert obs == "Question 42: who?" and info["env_id"] == 7
    reply = "<think>hm</think><search>who</search>"
    assert env.step(reply).observation.startswith("<information>")
    assert env.observe() == "Question: who?"
    res = env.step("<answer>Ada</answer>")
    assert res.reward == 1.0 and res.terminated
    env.close()
    assert seen["deepsearch"] == [
        ("create", {"id": 42}), ("reset", {"env_idx": 7, "id": 42}),
        ("step", {"env_idx": 7, "action": reply}), ("observation", {"env_idx": 7}),
        ("step", {"env_idx": 7, "action": "<answer>Ada</answer>"}), ("close", {"env_idx": 7})]

    # WebArena: env_idx, reset {seed, idx}, terminated/truncated, plain-text /close
    env = fast_env(f"{srv.url}/webarena", "webarena", dialect="webarena")
    assert env.reset(9)[0] == "Tab 0: page for config 9"
    res = env.step("In summary, the next action I will perform is ```stop [done]```")
    assert res.terminated and not res.truncated and res.reward == 1.0 and res.info["page"] == "x"
    env.close()
    assert seen["webarena"][1][1] == {"env_idx": 3, "seed": 0, "idx": 9}
    assert seen["webarena"][-1] == ("close", {"env_idx": 3})


def test_babyai_over_http_matches_in_process(start_server):
    srv = start_server(create_app("babyai", max_envs=2))
    local = env_adapters.make_env("babyai")
    remote = fast_env(srv.url, "babyai", timeout_s=20)
    try:
        lo, _ = local.reset(3, seed=1)
        ro, _ = remote.reset(3, seed=1)
        assert ro == lo
        action = (local.valid_actions() or ["turn left"])[0]
        ls, rs = local.step(action), remote.step(action)
        assert (rs.observation, rs.reward, rs.terminated, rs.truncated) == \
               (ls.observation, ls.reward, ls.terminated, ls.truncated)
    finally:
        local.close()
        remote.close()
