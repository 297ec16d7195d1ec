"""SciWorld adapter: AgentGym's task list, prompt, reset text, running score, parsing, and the
JVM pool (reuse, bounds, crash / timeout -> InfraError, no leaked JVM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

pytest.importorskip("scienceworld")
psutil = pytest.importorskip("psutil")

from env_adapters import InfraError, make_env  # noqa: E402
from env_adapters import sciworld as sw  # noqa: E402
from env_adapters.sciworld import (  # noqa: E402
    EXCLUDED_TASK_IDS, NUM_GAMES, POOL, SYSTEM_PROMPT, JVMPool, SciWorldEnv, ScienceWorldJVM,
    data_idx_for, parse_reply, task_for)

pytestmark = pytest.mark.timeout(180)

FIND_LIVING_0 = 2936  # 4-1 find-living-thing, variation 0: a 10-step gold path
LONGEST_LIVED_0 = 4240  # 7-1 lifespan-longest-lived, variation 0


def act(env, action: str):
    return env.step(f"Thought:\nNext step.\n\nAction:\n{action}")


def stop_every_thread(pid: int, deadline_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait until all its threads are stopped.

    ``kill`` returns before a group stop completes: one thread is woken to start it, and until
    it runs, another thread (the JVM's socket reader) can still answer a call that arrives.
    Under load, that window let a "hung" JVM answer the test's call."""
    os.kill(pid, signal.SIGSTOP)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            if all(psutil.Process(t.id).status() == psutil.STATUS_STOPPED
                   for t in psutil.Process(pid).threads()):
                return
        except psutil.NoSuchProcess:  # a thread that exited meanwhile: look again
            pass
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} did not stop within {deadline_s} s")


def java_children() -> list[int]:
    return sorted(p.pid for p in psutil.Process().children(recursive=True)
                  if p.name().startswith("java"))


# ---------------------------------------------------------------------------- no JVM needed
def test_task_mapping_agentgym_order():
    assert NUM_GAMES == 4639
    assert task_for(0) == ("1-1", "boil", 0)
    assert task_for(29) == ("1-1", "boil", 29)
    assert task_for(30) == ("1-2", "melt", 0)
    assert task_for(120) == ("2-1", "use-thermometer", 0)
    assert task_for(FIND_LIVING_0) == ("4-1", "find-living-thing", 0)
    assert task_for(4136) == ("6-1", "chemistry-mix", 0)  # 5-x are skipped
    assert task_for(4638) == ("8-2", "identify-life-stages-2", 9)
    assert task_for(4639) == task_for(0) and task_for(4639 + 31) == task_for(31)  # wraps
    codes = [code for code, _, _ in sw.TASKS]
    assert not EXCLUDED_TASK_IDS & set(codes) and len(codes) == 23
    for i in (0, 1, 777, 2936, 4638):
        code, name, var = task_for(i)
        assert data_idx_for(code, var) == i == data_idx_for(name, var)
    with pytest.raises(ValueError):
        task_for(-1)
    with pytest.raises(ValueError):
        data_idx_for("5-1", 0)  # excluded by AgentGym


def test_parse_reply():
    assert parse_reply("Thought:\nI should look.\n\nAction:\nlook around") == ("look around", "")
    assert parse_reply("Action: Open door to kitchen.")[0] == "open door to kitchen"
    assert parse_reply("Action: focus on green-blue paint")[0] == "focus on green-blue paint"
    assert parse_reply("Action:\n**pick up thermometer**\nmore text")[0] == "pick up thermometer"
    assert parse_reply("Action: go to hallway\nAction: look around</s>")[0] == "look around"
    assert parse_reply("0")[0] == "0"  # answers to the simulator's disambiguation menu
    for junk in ("", "Action:", "\x00\x01", "x" * 5000, "two\nlines without the marker"):
        assert parse_reply(junk)[0] is None


def test_system_prompt_is_agentgyms():
    assert SYSTEM_PROMPT.startswith("You are an agent for science world. Every round I will")
    assert '{"action": "focus on OBJ", "description": "signal intent on a task object"}' \
        in SYSTEM_PROMPT
    assert SYSTEM_PROMPT.endswith(
        "Your response should use the following format:\nThought:\nyour thoughts.\n\n"
        "Action:\nyour next action")
    assert SciWorldEnv().system_prompt() == SYSTEM_PROMPT


class _FakeJVM:
    n = 0

    def __init__(self) -> None:
        _FakeJVM.n += 1
        self.id, self.dead, self.killed = _FakeJVM.n, False, 0

    def alive(self) -> bool:
        return not self.dead and not self.killed

    def kill(self, force: bool = False) -> None:
        self.killed += 1


def test_pool_bounds_reuse_and_discard_without_jvms():
    pool = JVMPool("fake", _FakeJVM, size=2, max_idle=1, acquire_timeout_s=0.3)
    a, b = pool.acquire(), pool.acquire()
    t0 = time.monotonic()
    with pytest.raises(InfraError, match="busy"):
        pool.acquire()  # bounded: a third waits, then fails
    assert time.monotonic() - t0 >= 0.25
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire()))
    pool.acquire_timeout_s = 5
    waiter.start()
    time.sleep(0.1)
    pool.release(a)  # wakes the waiter, which reuses a
    waiter.join(5)
    assert got == [a] and pool.stats()["reused"] == 1
    pool.release(a)
    pool.release(a)  # twice: ignored
    pool.release(b)  # max_idle=1: b is killed, not kept
    assert b.killed == 1 and a.killed == 0 and pool.stats()["idle"] == 1
    a.dead = True  # an idle JVM that died is replaced, not handed out
    c = pool.acquire()
    assert c is not a and a.killed == 1
    pool.discard(c)
    assert c.killed == 1 and pool.stats()["live"] == 0
    d = pool.acquire()
    pool.shutdown()
    assert d.killed == 1 and pool.stats()["live"] == 0
    pool.release(d)  # after shutdown: ignored
    assert pool.stats()["idle"] == 0


# ---------------------------------------------------------------------------- with the simulator
@pytest.fixture(scope="module")
def env():
    e = SciWorldEnv()
    yield e
    e.close()


def test_mapping_matches_agentgyms_construction(env):
    env.reset(0)
    jvm = env._jvm
    games = []  # agentenv_sciworld/environment.py, SciWorldEnv.create
    for key, value in jvm.tasks.items():
        if key not in {"5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2"}:
            games += [{"taskName": value, "variationIdx": i}
                      for i in range(jvm.get_max_variations(value))]
    assert len(games) == NUM_GAMES
    assert [(g["taskName"], g["variationIdx"]) for g in games] == \
        [task_for(i)[1:] for i in range(NUM_GAMES)]


def test_reset_is_agentgyms_observation(env):
    obs, info = env.reset(FIND_LIVING_0, seed=3)
    jvm = env._jvm
    assert info["task_name"] == "find-living-thing" and info["variation"] == 0
    assert info["seed"] == 3 and info["score"] == 0 and info["success"] is False
    assert info["reward_is_cumulative"] is True
    description = jvm.get_task_description()
    assert description.startswith("Your task is to find a(n) living thing.")
    assert obs == description + "\n" + jvm.look().rstrip("\n")  # description + "look around"
    assert obs.splitlines()[1] == "This room is called the hallway. In it, you see: "
    assert env.reset(FIND_LIVING_0, seed=0)[0] == obs  # the seed does not change the world


def test_running_score_invalid_action_and_format_error(env):
    env.reset(FIND_LIVING_0)
    r = act(env, "open door to greenhouse")
    assert r.reward == pytest.approx(0.08) and r.info["score"] == 8 and not r.terminated
    assert r.info["parsed_action"] == "open door to greenhouse" and not r.info["invalid_action"]
    r = act(env, "fly to the moon")
    assert r.observation == "No known action matches that input."
    assert r.info["invalid_action"] and r.reward == pytest.approx(0.08)
    r = env.step("I think I will\nlook around")  # no Action: line
    assert r.info["format_error"] is True and r.observation.startswith("Invalid format")
    assert r.reward == pytest.approx(0.08)  # the running score survives a bad reply
    assert not r.terminated and r.info["reward_is_cumulative"] is True
    r = act(env, "focus on picture")  # not a living thing: score -100, the task fails
    assert r.info["score"] == -100 and r.reward == 0.0 and r.terminated
    assert r.info["success"] is False and isinstance(r.reward, float)
    r = act(env, "look around")  # stepping a finished episode
    assert r.terminated and r.reward == 0.0 and r.observation == "The task has finished."
    assert env.valid_actions() is None


def test_step_limit_is_truncation():
    e = SciWorldEnv(step_limit=3)
    try:
        e.reset(FIND_LIVING_0)
        for _ in range(10):
            r = act(e, "wait1")
            if r.terminated or r.truncated:
                break
        assert r.truncated and not r.terminated and r.info["step_limit_reached"]
        assert r.info["moves"] > 3
    finally:
        e.close()


@pytest.mark.parametrize("data_idx", [FIND_LIVING_0, LONGEST_LIVED_0])
def test_gold_path_reaches_reward_1(data_idx):
    plain_obs = None
    with SciWorldEnv() as plain:
        plain_obs, _ = plain.reset(data_idx)
    e = SciWorldEnv(gold_path=True)
    try:
        obs, _ = e.reset(data_idx)
        assert obs == plain_obs  # generating the gold path does not change the world
        gold = e.gold_actions()
        assert 3 <= len(gold) <= 20
        rewards = []
        for a in gold:  # the simulator's gold paths may carry a trailing no-op past the goal
            r = act(e, a)
            rewards.append(r.reward)
            assert not r.info["format_error"] and not r.info["invalid_action"], (a, r)
            if r.terminated:
                break
        assert len(rewards) >= len(gold) - 1
        assert r.terminated and r.reward == 1.0 and r.info["success"] is True
        assert r.info["score"] == 100 and rewards == sorted(rewards)  # progress only grows
    finally:
        e.close()


def test_valid_actions_are_simulator_combinations(env):
    env.reset(LONGEST_LIVED_0)
    va = env.valid_actions()
    assert isinstance(va, list) and len(va) > 50 and "look around" in va
    assert va == env.valid_actions()  # cached until the next step
    r = act(env, va[va.index("look around")])
    assert not r.info["invalid_action"]


def test_close_returns_the_jvm_to_the_pool_and_reuses_it():
    a = SciWorldEnv()
    a.reset(0)
    pid = a._jvm.pid
    assert pid in java_children()
    before = POOL.stats()
    a.close()
    a.close()  # idempotent
    after = POOL.stats()
    assert after["leased"] == before["leased"] - 1 and after["idle"] == before["idle"] + 1
    assert pid in java_children()  # returned, not killed
    b = SciWorldEnv()
    b.reset(30)
    assert b._jvm.pid == pid  # the most recently returned JVM is reused
    b.close()
    with pytest.raises(RuntimeError):
        a.reset(0)


def test_crashed_jvm_is_infra_error_and_discarded():
    e = SciWorldEnv()
    try:
        e.reset(FIND_LIVING_0)
        pid = e._jvm.pid
        discarded = POOL.stats()["discarded"]
        os.kill(pid, signal.SIGKILL)
        psutil.Process(pid).wait(10) if psutil.pid_exists(pid) else None
        with pytest.raises(InfraError, match="sciworld"):
            act(e, "look around")
        assert POOL.stats()["discarded"] == discarded + 1
        assert pid not in java_children() and pid not in POOL.pids()
        obs, _ = e.reset(FIND_LIVING_0)  # the next episode gets a fresh JVM
        assert e._jvm.pid != pid and obs.startswith("Your task is to find")
    finally:
        e.close()


def test_hung_jvm_times_out_as_infra_error():
    # the timeout covers every gateway call, the JVM's start and the task load too: 2 s was
    # too tight for those on a loaded machine; 8 s still tells a hung JVM apart
    pool = JVMPool("sciworld-timeout", lambda: ScienceWorldJVM(call_timeout_s=8.0), size=1)
    e = SciWorldEnv(pool=pool)
    try:
        e.reset(LONGEST_LIVED_0)
        pid = e._jvm.pid
        stop_every_thread(pid)
        t0 = time.monotonic()
        with pytest.raises(InfraError):
            act(e, "look around")
        assert time.monotonic() - t0 < 30
        assert pool.stats()["live"] == 0 and pid not in java_children()
    finally:
        e.close()
        pool.shutdown()


def test_make_env_and_shutdown_pool():
    e = make_env("sciworld")
    e.reset(0)
    pids = POOL.pids()
    assert pids and set(pids) <= set(java_children())
    sw.shutdown_pool()  # kills idle *and* leased JVMs
    assert not set(pids) & set(java_children()) and POOL.stats()["live"] == 0
    with pytest.raises(InfraError):
        act(e, "look around")
    e.close()


def test_no_jvm_survives_the_process(tmp_path):
    """An episode left open at exit: atexit's shutdown_pool (and py4j's die-on-broken-pipe)."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {_ROOT!r})
        from env_adapters.sciworld import SciWorldEnv
        e = SciWorldEnv()
        e.reset(0)
        print(e._jvm.pid, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True)
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    alive = psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    assert not alive, f"JVM {pid} outlived its Python process"


# ---------------------------------------------------------------------------- 100 episodes
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_100_episodes_leak_no_jvm_and_no_memory():
    """100 episodes in a row (2 steps each) over 10 task families, one adapter per episode.

    Tolerances, measured after a 50-episode warm-up: the java children are the same processes
    (one pooled JVM, reused); this process's RSS grows < 25 MB; the JVM's live heap after a
    full GC grows < 16 MB (a leak in the simulator would show here); the JVM's RSS grows
    < 64 MB and stays < 512 MB (it creeps while the heap expands lazily toward its -Xmx256m
    cap, hence the warm-up; its trajectory has no committed record).
    """
    tasks = [0, 30, 120, 1396, 1436, FIND_LIVING_0, 3536, 4136, LONGEST_LIVED_0, 4615]
    me = psutil.Process()
    jvms = set()

    def episode(k: int):
        e = SciWorldEnv()
        try:
            e.reset(tasks[k % len(tasks)] + k // len(tasks))
            act(e, "look around")
            act(e, "inventory")
            jvms.add(e._jvm.pid)
            return e._jvm
        finally:
            e.close()

    def live_heap(jvm) -> int:  # bytes in use after a full GC
        rt = jvm._gateway.jvm.java.lang.Runtime.getRuntime()
        jvm._gateway.jvm.java.lang.System.gc()
        return rt.totalMemory() - rt.freeMemory()

    def sample(jvm, label):
        java = java_children()
        stats = (java, me.memory_info().rss, psutil.Process(jvm.pid).memory_info().rss,
                 live_heap(jvm))
        print(f"{label}: java {java}, python RSS {stats[1] >> 20} MB, JVM RSS "
              f"{stats[2] >> 20} MB, JVM live heap {stats[3] >> 20} MB")
        return stats

    for k in range(50):
        jvm = episode(k)
    java0, rss0, jrss0, heap0 = sample(jvm, "after warm-up")
    t0 = time.perf_counter()
    for k in range(100):
        jvm = episode(50 + k)
        if k % 25 == 24 and k < 99:
            sample(jvm, f"episode {k + 1}")
    elapsed = time.perf_counter() - t0
    java1, rss1, jrss1, heap1 = sample(jvm, "after 100 episodes")
    print(f"100 episodes in {elapsed:.1f} s ({elapsed * 10:.0f} ms each); pool {POOL.stats()}")
    assert java1 == java0 and len(jvms) == 1 and jvms <= set(java1)
    assert rss1 - rss0 < 25 << 20
    assert heap1 - heap0 < 16 << 20
    assert jrss1 - jrss0 < 64 << 20 and jrss1 < 512 << 20
