"""ScienceWorld as AgentGym serves it (``agentenv-sciworld``), in-process over ``scienceworld``.

A re-implementation of ``agentenv_sciworld/environment.py`` (WooooDyy/AgentGym) with the AgentGym
client (``agentenv/envs/sciworld.py``) in front of it, on the same ``scienceworld==1.2.3`` that
AgentGym's ``uv.lock`` pins:

* **Tasks.** AgentGym builds its id list once per server from ``ScienceWorldEnv.tasks`` (ordered
  ``"1-1" .. "10-2"``), skipping ``5-1, 5-2, 9-1, 9-2, 9-3, 10-1, 10-2``, and appends every
  variation of each remaining task in order: ``data_idx`` -> ``(task, variation)`` over
  :data:`NUM_GAMES` = 4,639 entries (:func:`task_for`; 0 -> boil #0, 30 -> melt #0, 4638 ->
  identify-life-stages-2 #9). The table is frozen here (:data:`TASKS`) so the mapping needs no
  JVM; a test checks it against the simulator. Indices past the end wrap around (AgentGym's list
  grows by a copy per ``/create``, so its large indices repeat the list too). ``seed`` does not
  change the world: a ScienceWorld variation *is* the world (it is recorded in ``info``).
* **Reset.** ``load(task, variation)`` (no simplifications, AgentGym's default), then
  ``step("look around")``; the first observation is ``task_description + "\\n" + look``, exactly
  the AgentGym client's ``reset``.
* **Reward.** AgentGym's client reports the server's ``score`` (0..100, -100 on failure) as the
  reward. Here: ``clip(score / 100, 0, 1)`` as a *running* score with
  ``info["reward_is_cumulative"] = True`` (the rollout keeps the last value); the raw score is
  ``info["score"]``. A negative score ends the task (``terminated``, reward 0, not success);
  ``success`` is a completed task with score 100.
* **Actions.** The ReAct reply is parsed like the sibling adapters (text after the *last*
  ``Action:``, first non-empty line; a one-line reply without the marker is the action),
  lower-cased (the simulator's parser is case-insensitive), reduced to ``[a-z0-9 -]`` (drops a
  trailing period, quotes, markdown). An action the simulator does not understand is passed
  through like AgentGym does: its answer (``No known action matches that input.``) is the
  observation and ``info["invalid_action"]`` is set. Ambiguous actions get the simulator's
  numbered menu; the agent answers with the number.

Deliberate differences from AgentGym: the reply parsing above (AgentGym sends everything after the
first ``Action:``), an empty / unparseable / over-long reply is a format error (turn consumed,
running score unchanged); the simulator's own 100-move limit (``envStepLimit``) ends the episode
as ``truncated`` (a horizon), not ``terminated``; stepping a finished episode returns a terminal
observation instead of the server's error. The step calls the simulator directly
(``step``/``getScore``/``getCompleted``/``getNumMoves``) instead of ``ScienceWorldEnv.step``,
which also computes look / inventory / every valid action combination on each step (~100 ms,
unused by AgentGym): same observation, score and completion, ~2-5 ms a step.

**JVM pool.** Every ScienceWorld world lives in its own JVM (py4j; ~1-2 s to start, ~300-400 MB
resident with the default ``-Xmx256m``). A process-wide :class:`JVMPool` keeps them: an adapter
leases one on its first ``reset`` and keeps it across resets; ``close()`` hands it back (it is not
killed) and the next adapter reuses it (``load`` rebuilds the world, so a reused JVM gives the
same observations as a fresh one). At most ``size`` JVMs live at once (idle + leased; an
``acquire`` beyond that waits up to ``acquire_timeout_s``, then raises :class:`InfraError`); at
most ``max_idle`` are kept idle. A JVM that crashed, timed out (every call has a read timeout)
or raised is killed and dropped from the pool, and the call raises :class:`InfraError`.
:func:`shutdown_pool` kills them all (registered with ``atexit``; the JVMs also die with this
process, py4j's ``--die-on-broken-pipe``). Settings: :func:`configure_pool` or the environment
variables ``SCIWORLD_POOL_SIZE``, ``SCIWORLD_POOL_MAX_IDLE``, ``SCIWORLD_JAVA_OPTS``,
``SCIWORLD_CALL_TIMEOUT_S``, ``SCIWORLD_ACQUIRE_TIMEOUT_S``. :class:`JVMPool` is generic: the
TextWorldExpress adapter uses it too.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shlex
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from scienceworld import ScienceWorldEnv

from env_adapters.base import InfraError, StepResult, TextEnv, format_error

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- AgentGym data
#: Task ids AgentGym leaves out of its list (agentenv_sciworld/environment.py, ``exceptions``).
EXCLUDED_TASK_IDS = frozenset({"5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2"})

#: ``(task id, task name, variations)`` in ``ScienceWorldEnv.tasks`` order without the excluded
#: ids, as scienceworld 1.2.3 reports them (``getMaxVariations``); checked by the tests.
TASKS: tuple[tuple[str, str, int], ...] = (
    ("1-1", "boil", 30),
    ("1-2", "melt", 30),
    ("1-3", "freeze", 30),
    ("1-4", "change-the-state-of-matter-of", 30),
    ("2-1", "use-thermometer", 540),
    ("2-2", "measure-melting-point-known-substance", 436),
    ("2-3", "measure-melting-point-unknown-substance", 300),
    ("3-1", "power-component", 20),
    ("3-2", "power-component-renewable-vs-nonrenewable-energy", 20),
    ("3-3", "test-conductivity", 900),
    ("3-4", "test-conductivity-of-unknown-substances", 600),
    ("4-1", "find-living-thing", 300),
    ("4-2", "find-non-living-thing", 300),
    ("4-3", "find-plant", 300),
    ("4-4", "find-animal", 300),
    ("6-1", "chemistry-mix", 32),
    ("6-2", "chemistry-mix-paint-secondary-color", 36),
    ("6-3", "chemistry-mix-paint-tertiary-color", 36),
    ("7-1", "lifespan-longest-lived", 125),
    ("7-2", "lifespan-shortest-lived", 125),
    ("7-3", "lifespan-longest-lived-then-shortest-lived", 125),
    ("8-1", "identify-life-stages-1", 14),
    ("8-2", "identify-life-stages-2", 10),
)
#: first ``data_idx`` of each task in :data:`TASKS`
TASK_OFFSETS: tuple[int, ...] = tuple(
    sum(n for _, _, n in TASKS[:i]) for i in range(len(TASKS)))
NUM_GAMES = sum(n for _, _, n in TASKS)  # 4639

#: The human turn of AgentGym's ``SciworldEnvClient.conversation_start``.
SYSTEM_PROMPT = (
    'You are an agent for science world. Every round I will give you an observation, you have '
    'to respond an action based on the observation to finish the given task. Here are the '
    'actions you may take: [{"action": "open/close OBJ", "description": "open/close a '
    'container"}, {"action": "de/activate OBJ", "description": "activate/deactivate a '
    'device"}, {"action": "connect OBJ to OBJ", "description": "connect electrical '
    'components"}, {"action": "disconnect OBJ", "description": "disconnect electrical '
    'components"}, {"action": "use OBJ [on OBJ]", "description": "use a device/item"}, '
    '{"action": "look around", "description": "describe the current room"}, {"action": "look '
    'at OBJ", "description": "describe an object in detail"}, {"action": "look in OBJ", '
    '"description": "describe a container\'s contents"}, {"action": "read OBJ", '
    '"description": "read a note or book"}, {"action": "move OBJ to OBJ", "description": '
    '"move an object to a container"}, {"action": "pick up OBJ", "description": "move an '
    'object to the inventory"}, {"action": "put down OBJ", "description": "drop an inventory '
    'item"}, {"action": "pour OBJ into OBJ", "description": "pour a liquid into a '
    'container"}, {"action": "dunk OBJ into OBJ", "description": "dunk a container into a '
    'liquid"}, {"action": "mix OBJ", "description": "chemically mix a container"}, '
    '{"action": "go to LOC", "description": "move to a new location"}, {"action": "eat OBJ", '
    '"description": "eat a food"}, {"action": "flush OBJ", "description": "flush a toilet"}, '
    '{"action": "focus on OBJ", "description": "signal intent on a task object"}, {"action": '
    '"wait", "description": "take no action for 10 iterations"}, {"action": "wait1", '
    '"description": "take no action for 1 iteration"}, {"action": "task", "description": '
    '"describe current task"}, {"action": "inventory", "description": "list your '
    'inventory"}]\nYour response should use the following format:\nThought:\nyour '
    'thoughts.\n\nAction:\nyour next action'
)
#: The scripted assistant turn that follows it in AgentGym's conversation start.
ASSISTANT_ACK = "OK. I'll follow your instructions and try my best to solve the task."

MAX_REPLY_CHARS = 2000
SIMPLIFICATIONS = frozenset({"easy", "teleportAction", "selfWateringFlowerPots", "openContainers",
                             "openDoors", "noElectricalAction"})
INVALID_ACTION_TEXT = "No known action matches that input."
#: The simulator's live heap is ~30 MB after a GC; 256 MB leaves room for gold-path generation
#: (128 MB is too little for it) and keeps a JVM at ~350 MB resident.
DEFAULT_JAVA_OPTS = ("-Xmx256m", "-XX:+UseSerialGC")


def task_for(data_idx: int) -> tuple[str, str, int]:
    """AgentGym's mapping: ``(task id, task name, variation)`` for ``data_idx`` (wraps around)."""
    if data_idx < 0:
        raise ValueError("data_idx must be >= 0")
    i = int(data_idx) % NUM_GAMES
    for k in range(len(TASKS) - 1, -1, -1):
        if i >= TASK_OFFSETS[k]:
            code, name, _ = TASKS[k]
            return code, name, i - TASK_OFFSETS[k]
    raise AssertionError("unreachable")


def data_idx_for(task: str, variation: int) -> int:
    """Inverse of :func:`task_for`: the ``data_idx`` of ``task`` (id or name) ``variation``."""
    for k, (code, name, n) in enumerate(TASKS):
        if task in (code, name):
            if not 0 <= variation < n:
                raise ValueError(f"{name} has {n} variations, not {variation}")
            return TASK_OFFSETS[k] + variation
    raise ValueError(f"unknown or excluded task {task!r}")


def parse_reply(reply: str, max_chars: int = MAX_REPLY_CHARS) -> tuple[str | None, str]:
    """Extract the action from a ReAct reply; returns ``(action, "")`` or ``(None, why)``."""
    if not isinstance(reply, str):
        return None, "the reply is not text"
    if len(reply) > max_chars:
        return None, f"the reply is longer than {max_chars} characters"
    text = reply
    for eos in ("</s>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        text = text.replace(eos, "\n")
    markers = list(re.finditer(r"action\s*:", text, flags=re.IGNORECASE))
    if markers:
        tail = text[markers[-1].end():]
    elif len([ln for ln in text.splitlines() if ln.strip()]) == 1:
        tail = text
    else:
        return None, 'no "Action:" line'
    line = next((ln for ln in tail.splitlines() if ln.strip()), "")
    action = " ".join(re.sub(r"[^a-z0-9\- ]+", " ", line.lower()).split()).strip(" -")
    if not action:
        return None, 'nothing after "Action:"'
    return action, ""


# ---------------------------------------------------------------------------- JVM plumbing
class PooledJVM(Protocol):
    def alive(self) -> bool: ...

    def kill(self, force: bool = False) -> None:
        """Stop the JVM (``force``: no grace period, it is broken); idempotent."""


J = TypeVar("J", bound=PooledJVM)


def launch_jvm(classpath: str, cwd: str, java_opts: list[str], call_timeout_s: float):
    """Start a py4j gateway JVM; returns ``(gateway, proc)``.

    Unlike the packages' own constructors: no Python callback server (neither simulator calls
    back into Python; it would cost a thread and a socket per JVM), JVM options of our choosing,
    and a read timeout on every call so that a hung simulator surfaces as an error.
    """
    from py4j.java_gateway import GatewayParameters, JavaGateway, launch_gateway

    port, proc = launch_gateway(classpath=classpath, die_on_exit=True, cwd=cwd,
                                javaopts=list(java_opts), return_proc=True)
    try:
        gateway = JavaGateway(
            gateway_parameters=GatewayParameters(
                auto_field=True, port=port, read_timeout=call_timeout_s or None),
            java_process=proc)
    except BaseException:
        stop_jvm(None, proc)
        raise
    return gateway, proc


def stop_jvm(gateway: Any, proc: subprocess.Popen | None, grace_s: float = 5.0) -> None:
    """Stop a gateway JVM and release every handle on it; never raises, safe to repeat.

    Closes its stdin (py4j's ``--die-on-broken-pipe`` makes it exit), waits up to ``grace_s``,
    then SIGKILLs it (``grace_s=0``: at once, for a crashed or hung JVM)."""
    if proc is not None:
        try:
            if proc.poll() is None and proc.stdin is not None:
                proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=grace_s) if grace_s > 0 else None
        except subprocess.TimeoutExpired:
            pass
        if proc.poll() is None:
            proc.kill()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - unkillable process
                log.error("JVM pid %s did not die", proc.pid)
        # py4j's reader thread sees EOF once the process is gone; let it finish, then close
        for t in threading.enumerate():
            if getattr(t, "stream", None) is proc.stdout and t is not threading.current_thread():
                t.join(timeout=1.0)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            try:
                if stream is not None:
                    stream.close()
            except (OSError, ValueError):
                pass
    if gateway is not None:
        try:
            gateway.close(keep_callback_server=True)  # close the sockets (no Java call)
        except Exception:  # noqa: BLE001 - best effort
            pass


class JVMPool(Generic[J]):
    """A bounded, thread-safe, process-wide pool of simulator JVMs reused across episodes.

    ``size`` bounds the JVMs alive at once (idle + leased); ``max_idle`` bounds those kept
    waiting. ``acquire`` prefers the most recently returned idle JVM, starts a new one while
    under ``size``, otherwise waits up to ``acquire_timeout_s`` (then :class:`InfraError`).
    ``release`` returns a healthy JVM (or kills it when the idle list is full), ``discard`` kills
    a broken one. After a ``fork`` the child starts with an empty pool (the JVMs are the
    parent's).
    """

    def __init__(self, name: str, factory: Callable[[], J], *, size: int = 32,
                 max_idle: int | None = None, acquire_timeout_s: float = 600.0) -> None:
        if size < 1:
            raise ValueError("size must be >= 1")
        self.name = name
        self.factory = factory
        self.size = size
        self.max_idle = size if max_idle is None else max(0, max_idle)
        self.acquire_timeout_s = acquire_timeout_s
        self._cond = threading.Condition()
        self._idle: list[J] = []
        self._leased: set[int] = set()
        self._objs: dict[int, J] = {}
        self._live = 0  # idle + leased + being started
        self._pid = os.getpid()
        self.created = 0
        self.discarded = 0
        self.reused = 0

    def _check_fork(self) -> None:
        if os.getpid() != self._pid:  # a forked child: the JVMs belong to the parent
            self._cond = threading.Condition()
            self._idle, self._leased, self._objs, self._live = [], set(), {}, 0
            self._pid = os.getpid()

    def acquire(self) -> J:
        self._check_fork()
        deadline = time.monotonic() + self.acquire_timeout_s
        dead: list[J] = []
        try:
            with self._cond:
                while True:
                    while self._idle:
                        jvm = self._idle.pop()
                        if jvm.alive():
                            self._leased.add(id(jvm))
                            self.reused += 1
                            return jvm
                        self._forget(jvm)
                        dead.append(jvm)
                    if self._live < self.size:
                        self._live += 1
                        break
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise InfraError(
                            f"{self.name}: all {self.size} JVMs are busy after waiting "
                            f"{self.acquire_timeout_s:.0f} s (raise the pool size)")
                    self._cond.wait(remaining)
        finally:
            for jvm in dead:
                jvm.kill(force=True)
        try:
            jvm = self.factory()
        except BaseException as e:
            with self._cond:
                self._live -= 1
                self._cond.notify()
            if isinstance(e, InfraError):
                raise
            if not isinstance(e, Exception):
                raise
            raise InfraError(f"{self.name}: could not start a JVM: {describe_error(e)}") from e
        with self._cond:
            self._objs[id(jvm)] = jvm
            self._leased.add(id(jvm))
            self.created += 1
        return jvm

    def _forget(self, jvm: J) -> None:  # under the lock
        self._objs.pop(id(jvm), None)
        self._leased.discard(id(jvm))
        self._live -= 1
        self.discarded += 1
        self._cond.notify()

    def release(self, jvm: J) -> None:
        """Give a leased JVM back; it is kept idle if healthy and there is room, else killed."""
        self._check_fork()
        kill = False
        with self._cond:
            if id(jvm) not in self._leased or self._objs.get(id(jvm)) is not jvm:
                return  # not ours (any more): discarded, shut down, or released twice
            self._leased.discard(id(jvm))
            if jvm.alive() and len(self._idle) < self.max_idle:
                self._idle.append(jvm)
                self._cond.notify()
            else:
                self._objs.pop(id(jvm), None)
                self._live -= 1
                self._cond.notify()
                kill = True
        if kill:
            jvm.kill()

    def discard(self, jvm: J) -> None:
        """Kill a broken JVM and forget it (it will not be handed out again)."""
        self._check_fork()
        with self._cond:
            if self._objs.get(id(jvm)) is jvm:
                if jvm in self._idle:
                    self._idle.remove(jvm)
                self._forget(jvm)
        jvm.kill(force=True)

    def shutdown(self) -> None:
        """Kill every JVM of the pool, idle or leased; the pool stays usable afterwards."""
        self._check_fork()
        with self._cond:
            victims = list(self._objs.values())
            self._idle.clear()
            self._leased.clear()
            self._objs.clear()
            self._live -= len(victims)
            self._cond.notify_all()
        for jvm in victims:
            jvm.kill()

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"live": self._live, "idle": len(self._idle), "leased": len(self._leased),
                    "size": self.size, "max_idle": self.max_idle, "created": self.created,
                    "reused": self.reused, "discarded": self.discarded}

    def pids(self) -> list[int]:
        """Process ids of the pool's JVMs (idle and leased)."""
        with self._cond:
            return sorted(p for j in self._objs.values()
                          if (p := getattr(getattr(j, "_proc", None), "pid", None)))


def describe_error(e: BaseException, limit: int = 300) -> str:
    """``Type: message`` of a simulator error, safely: formatting a ``Py4JJavaError`` asks the
    JVM for the Java stack trace, which itself raises when the JVM is dead."""
    try:
        text = " ".join(str(e).split())
    except Exception:  # noqa: BLE001
        text = "(no message: the JVM did not answer)"
    return f"{type(e).__name__}: {text[:limit]}"


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


# ---------------------------------------------------------------------------- the ScienceWorld JVM
class ScienceWorldJVM(ScienceWorldEnv):
    """``scienceworld.ScienceWorldEnv`` started our way (see :func:`launch_jvm`), poolable.

    Every ``ScienceWorldEnv`` method works on it (``load``, ``get_gold_action_sequence``,
    ``get_valid_action_object_combinations``, ...); :meth:`fast_step` is the per-step path.
    """

    def __init__(self, java_opts: list[str] | tuple[str, ...] = DEFAULT_JAVA_OPTS,
                 call_timeout_s: float = 60.0, env_step_limit: int = 100) -> None:
        from scienceworld.constants import BASEPATH, JAR_PATH

        self._killed = False
        self._gateway, self._proc = launch_jvm(JAR_PATH, BASEPATH, list(java_opts), call_timeout_s)
        try:
            self.server = self._gateway.jvm.scienceworld.runtime.pythonapi.PythonInterface()
        except BaseException:
            self.kill()
            raise
        # the attributes ScienceWorldEnv's methods use
        self.lastStepScore = 0
        self.taskName = None
        self.variationIdx = 0
        self.simplificationStr = ""
        self.envStepLimit = env_step_limit
        self.goldPathGenerated = False

    @property
    def pid(self) -> int:
        return self._proc.pid

    def fast_step(self, action: str) -> tuple[str, int, bool, int]:
        """``(observation, score 0..100 or negative, completed, moves)`` of one simulator step."""
        obs = self.server.step(action)
        score = int(round(100 * self.server.getScore()))
        return obs, score, bool(self.server.getCompleted()), int(self.server.getNumMoves())

    def alive(self) -> bool:
        return not self._killed and self._proc.poll() is None

    def kill(self, force: bool = False) -> None:
        if self._killed:
            return
        self._killed = True
        stop_jvm(self._gateway, self._proc, grace_s=0 if force else 5.0)

    def close(self) -> None:
        self.kill()

    def __del__(self) -> None:
        try:
            self.kill()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _env_java_opts(var: str, default: tuple[str, ...]) -> list[str]:
    opts = os.environ.get(var)
    return shlex.split(opts) if opts is not None else list(default)


def _make_sciworld_jvm() -> ScienceWorldJVM:
    return ScienceWorldJVM(_env_java_opts("SCIWORLD_JAVA_OPTS", DEFAULT_JAVA_OPTS),
                           _env_float("SCIWORLD_CALL_TIMEOUT_S", 60.0))


POOL: JVMPool[ScienceWorldJVM] = JVMPool(
    "sciworld", _make_sciworld_jvm,
    size=int(_env_float("SCIWORLD_POOL_SIZE", 32)),
    max_idle=int(_env_float("SCIWORLD_POOL_MAX_IDLE", _env_float("SCIWORLD_POOL_SIZE", 32))),
    acquire_timeout_s=_env_float("SCIWORLD_ACQUIRE_TIMEOUT_S", 600.0),
)


def configure_pool(*, size: int | None = None, max_idle: int | None = None,
                   acquire_timeout_s: float | None = None, java_opts: list[str] | None = None,
                   call_timeout_s: float | None = None) -> dict[str, int]:
    """Change the process-wide pool's limits; JVM options / timeout apply to JVMs started later."""
    if size is not None:
        if size < 1:
            raise ValueError("size must be >= 1")
        POOL.size = size
    if max_idle is not None:
        POOL.max_idle = max(0, max_idle)
    if acquire_timeout_s is not None:
        POOL.acquire_timeout_s = acquire_timeout_s
    if java_opts is not None or call_timeout_s is not None:
        opts = list(java_opts) if java_opts is not None else None
        timeout = call_timeout_s

        def factory() -> ScienceWorldJVM:
            return ScienceWorldJVM(
                opts if opts is not None else _env_java_opts("SCIWORLD_JAVA_OPTS",
                                                             DEFAULT_JAVA_OPTS),
                timeout if timeout is not None else _env_float("SCIWORLD_CALL_TIMEOUT_S", 60.0))

        POOL.factory = factory
    return POOL.stats()


def pool_stats() -> dict[str, int]:
    """Counters of the process-wide ScienceWorld pool (live, idle, leased, created, ...)."""
    return POOL.stats()


def shutdown_pool() -> None:
    """Kill every pooled ScienceWorld JVM (idle or leased). Registered with ``atexit``."""
    POOL.shutdown()


atexit.register(shutdown_pool)


# ---------------------------------------------------------------------------- the adapter
class SciWorldEnv(TextEnv):
    """One ScienceWorld episode at a time on a pooled JVM, the AgentGym way."""

    name = "sciworld"

    def __init__(self, max_reply_chars: int = MAX_REPLY_CHARS, step_limit: int = 100,
                 simplifications: str = "", gold_path: bool = False,
                 pool: JVMPool | None = None) -> None:
        """``step_limit``: the simulator's move limit (AgentGym: ScienceWorldEnv's default 100).
        ``simplifications``: ScienceWorld's comma-separated list (AgentGym: none).
        ``gold_path``: also generate the gold action sequence at reset (slower; for tests and
        scripted baselines: :meth:`gold_actions`). ``pool``: a private :class:`JVMPool`."""
        unknown = {x for x in simplifications.split(",") if x} - SIMPLIFICATIONS
        if unknown:
            raise ValueError(f"unknown ScienceWorld simplifications {sorted(unknown)}; "
                             f"choose from {sorted(SIMPLIFICATIONS)}")
        self.max_reply_chars = max_reply_chars
        self.step_limit = step_limit
        self.simplifications = simplifications
        self.gold_path = gold_path
        self._pool: JVMPool = pool if pool is not None else POOL
        self._jvm: ScienceWorldJVM | None = None
        self._closed = False
        self._ready = False
        self._valid: list[str] | None = None

    # ------------------------------------------------------------------ TextEnv API
    def system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def reset(self, task_id: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
        if task_id < 0 or seed < 0:
            raise ValueError("task_id and seed must be >= 0")
        if self._closed:
            raise RuntimeError("environment is closed")
        code, task_name, variation = task_for(int(task_id))
        self._ready = False
        self._valid = None
        for attempt in (0, 1):  # a JVM that died while idle costs one retry on a fresh one
            jvm = self._lease()
            try:
                jvm.envStepLimit = self.step_limit
                jvm.load(task_name, variation, self.simplifications, self.gold_path)
                description = jvm.get_task_description()
                look, score, completed, moves = jvm.fast_step("look around")
                break
            except Exception as e:  # noqa: BLE001 - any simulator fault is infrastructure
                why = describe_error(e)  # before the JVM goes
                self._drop_jvm()
                if attempt == 1:
                    raise InfraError(
                        f"sciworld: reset of {task_name} #{variation} failed: {why}") from e
                log.warning("sciworld: reset failed on a pooled JVM (%s); retrying", why)
        self.task = {"task_id": int(task_id), "seed": int(seed), "task_code": code,
                     "task_name": task_name, "variation": variation}
        self.score = score
        self.moves = moves
        self.done = False
        self.success = False
        self._ready = True
        observation = description + "\n" + look
        info = {**self.task, "task_description": description, "score": score,
                "success": False, "reward_is_cumulative": True}
        return observation, info

    def step(self, action_text: str) -> StepResult:
        if not self._ready:
            raise RuntimeError("call reset() before step()")
        base = {**self.task, "success": self.success, "invalid_action": False,
                "format_error": False, "parsed_action": None, "score": self.score,
                "moves": self.moves, "reward_is_cumulative": True}
        if self.done:
            return StepResult("The task has finished.", self._reward(), True, False, base)
        action, why = parse_reply(action_text, self.max_reply_chars)
        if action is None:
            res = format_error(
                "Invalid format: " + why + '. End your reply with a line "Action: <action>", '
                'e.g. "Action: look around".', **{**base, "format_error": True})
            res.reward = self._reward()  # a running score: a bad reply does not erase progress
            return res
        base["parsed_action"] = action
        jvm = self._jvm
        if jvm is None:
            raise InfraError("sciworld: the JVM of this episode is gone (pool shut down?)")
        try:
            obs, score, completed, moves = jvm.fast_step(action)
        except Exception as e:  # noqa: BLE001 - crash, timeout, Java exception
            why = describe_error(e)
            self._drop_jvm()
            self._ready = False
            raise InfraError(f"sciworld: step {action!r} failed: {why}") from e
        self._valid = None
        self.score, self.moves = score, moves
        terminated = truncated = False
        if score < 0 or completed:  # ScienceWorldEnv: a negative score ends the task
            terminated = True
            self.success = completed and score >= 100
        elif moves > self.step_limit:  # ScienceWorldEnv's envStepLimit: a horizon, not an end
            truncated = True
        self.done = terminated or truncated
        info = {**base, "success": self.success, "score": score, "moves": moves,
                "invalid_action": obs.startswith(INVALID_ACTION_TEXT),
                "step_limit_reached": truncated}
        return StepResult(obs, self._reward(), terminated, truncated, info)

    def valid_actions(self) -> list[str] | None:
        """Every action-object combination the simulator accepts now (large: ~300-1000)."""
        if not self._ready or self._jvm is None or self.done:
            return None
        if self._valid is None:
            try:
                self._valid = list(self._jvm.get_valid_action_object_combinations())
            except Exception as e:  # noqa: BLE001
                why = describe_error(e)
                self._drop_jvm()
                self._ready = False
                raise InfraError(f"sciworld: listing valid actions failed: {why}") from e
        return list(self._valid)

    def gold_actions(self) -> list[str]:
        """The simulator's gold action sequence for the current task (needs ``gold_path=True``)."""
        if not self.gold_path:
            raise RuntimeError("create the environment with gold_path=True")
        if not self._ready or self._jvm is None:
            raise RuntimeError("call reset() first")
        return list(self._jvm.get_gold_action_sequence())

    def close(self) -> None:
        jvm, self._jvm = self._jvm, None
        self._ready = False
        self._closed = True
        if jvm is not None:
            self._pool.release(jvm)

    def __del__(self) -> None:
        try:
            if self._jvm is not None:
                self._pool.release(self._jvm)
                self._jvm = None
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ------------------------------------------------------------------ internals
    def _reward(self) -> float:
        return float(min(1.0, max(0.0, self.score / 100.0)))

    def _lease(self) -> ScienceWorldJVM:
        if self._jvm is not None and not self._jvm.alive():
            self._drop_jvm()
        if self._jvm is None:
            self._jvm = self._pool.acquire()
        return self._jvm

    def _drop_jvm(self) -> None:
        jvm, self._jvm = self._jvm, None
        if jvm is not None:
            self._pool.discard(jvm)
