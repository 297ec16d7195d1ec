"""Simulator JVMs for the ScienceWorld and TextWorldExpress adapters: start, pool, lease, stop.

Both simulators run in a JVM reached over py4j (slow to start; its heap alone may grow to
``-Xmx256m``). :func:`launch_jvm` starts one our way (no Python callback server, our JVM
options, a read timeout on every call); :func:`stop_jvm` stops it and releases every handle.
:class:`GatewayJVM` is the mixin that makes a simulator's Python class poolable (``alive``,
``kill``, ``pid``).

:class:`JVMPool` is a bounded, thread-safe, process-wide pool of such JVMs: an adapter leases
one on its first ``reset`` and keeps it across resets; ``close()`` hands it back (it is not
killed) and the next adapter reuses it. At most ``size`` JVMs live at once (idle + leased; an
``acquire`` beyond that waits up to ``acquire_timeout_s``, then raises :class:`InfraError`); at
most ``max_idle`` are kept idle. :meth:`JVMPool.from_env` reads the limits from
``{PREFIX}_POOL_SIZE``, ``{PREFIX}_POOL_MAX_IDLE`` and ``{PREFIX}_ACQUIRE_TIMEOUT_S``.

:class:`JVMTextEnv` is the adapters' common base: the lease, a reset that retries once on a
fresh JVM, and the rule that a JVM that crashed, timed out or raised is killed, dropped from the
pool, and reported as :class:`InfraError`.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from env_adapters.base import InfraError, TextEnv

log = logging.getLogger(__name__)
# py4j logs an ERROR with a traceback whenever a gateway finds its JVM gone, including the JVMs
# this module kills on purpose (pool shutdown at exit); JVM faults reach callers as InfraError.
logging.getLogger("py4j").setLevel(logging.CRITICAL)

T = TypeVar("T")


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


def describe_error(e: BaseException, limit: int = 300) -> str:
    """``Type: message`` of a simulator error, safely: formatting a ``Py4JJavaError`` asks the
    JVM for the Java stack trace, which itself raises when the JVM is dead."""
    try:
        text = " ".join(str(e).split())
    except Exception:  # noqa: BLE001
        text = "(no message: the JVM did not answer)"
    return f"{type(e).__name__}: {text[:limit]}"


def env_float(name: str, default: float) -> float:
    """The environment variable ``name`` as a float (``default`` when unset or not a number)."""
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def env_java_opts(var: str, default: tuple[str, ...]) -> list[str]:
    """JVM options from the environment variable ``var`` (shell words), else ``default``."""
    opts = os.environ.get(var)
    return shlex.split(opts) if opts is not None else list(default)


class GatewayJVM:
    """Mixin for a simulator's Python class running on a JVM of :func:`launch_jvm`: poolable
    (``alive``, ``kill``), killed by ``close()`` and on garbage collection.

    Put it first among the bases, so that its ``close`` replaces the package's own."""

    _killed: bool
    _gateway: Any
    _proc: subprocess.Popen

    def _launch(self, classpath: str, cwd: str, java_opts: list[str], call_timeout_s: float,
                entry_point: Callable[[Any], Any]) -> None:
        """Start the JVM and set ``self.server`` to ``entry_point(gateway.jvm)`` (the simulator's
        ``PythonInterface``); a JVM whose entry point fails is killed."""
        self._killed = False
        self._gateway, self._proc = launch_jvm(classpath, cwd, java_opts, call_timeout_s)
        try:
            self.server = entry_point(self._gateway.jvm)
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int:
        return self._proc.pid

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

    @classmethod
    def from_env(cls, name: str, factory: Callable[[], J], prefix: str) -> JVMPool[J]:
        """A pool whose limits come from ``{prefix}_POOL_SIZE`` (default 32),
        ``{prefix}_POOL_MAX_IDLE`` (default: the size) and ``{prefix}_ACQUIRE_TIMEOUT_S``
        (default 600)."""
        size = env_float(f"{prefix}_POOL_SIZE", 32)
        return cls(name, factory, size=int(size),
                   max_idle=int(env_float(f"{prefix}_POOL_MAX_IDLE", size)),
                   acquire_timeout_s=env_float(f"{prefix}_ACQUIRE_TIMEOUT_S", 600.0))

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


class JVMTextEnv(TextEnv):
    """Base of the adapters whose episodes run on a leased JVM (``self._jvm``, from ``pool``).
    ``gold_path``: the simulator also generates the gold action sequence at reset.

    The JVM is leased at the first reset and kept across resets; ``close()`` (or garbage
    collection) hands it back to the pool. A simulator call that fails discards the JVM and
    raises :class:`InfraError` (messages start with the adapter's ``name``).
    """

    def __init__(self, pool: JVMPool, gold_path: bool = False) -> None:
        self._pool: JVMPool = pool
        self.gold_path = gold_path
        self._jvm: Any = None
        self._closed = False
        self._ready = False

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

    def _reset_on_jvm(self, what: str, load: Callable[[Any], T],
                      caller_errors: tuple[type[Exception], ...] = ()) -> T:
        """``load(jvm)`` on the leased JVM. A failure costs one retry on a fresh JVM (the leased
        one may have died while idle), then :class:`InfraError` ``"{name}: {what} failed"``;
        ``caller_errors`` are the caller's fault and propagate as they are."""
        self._ready = False
        for attempt in (0, 1):
            jvm = self._lease()
            try:
                return load(jvm)
            except caller_errors:
                raise
            except Exception as e:  # noqa: BLE001 - any simulator fault is infrastructure
                why = describe_error(e)  # before the JVM goes
                self._drop_jvm()
                if attempt == 1:
                    raise InfraError(f"{self.name}: {what} failed: {why}") from e
                logging.getLogger(type(self).__module__).warning(
                    "%s: reset failed on a pooled JVM (%s); retrying", self.name, why)
        raise AssertionError("unreachable")

    def _call_jvm(self, what: str, call: Callable[[Any], T]) -> T:
        """``call(jvm)`` on this episode's JVM; a failure discards the JVM, ends the episode
        (until the next reset) and raises :class:`InfraError` ``"{name}: {what} failed"``."""
        jvm = self._jvm
        if jvm is None:
            raise InfraError(f"{self.name}: the JVM of this episode is gone (pool shut down?)")
        try:
            return call(jvm)
        except Exception as e:  # noqa: BLE001 - crash, timeout, Java exception
            why = describe_error(e)
            self._drop_jvm()
            self._ready = False
            raise InfraError(f"{self.name}: {what} failed: {why}") from e

    def _gold_jvm(self) -> Any:
        """The JVM to ask for the gold action sequence (after the checks it needs)."""
        if not self.gold_path:
            raise RuntimeError("create the environment with gold_path=True")
        if not self._ready or self._jvm is None:
            raise RuntimeError("call reset() first")
        return self._jvm

    def _lease(self) -> Any:
        if self._jvm is not None and not self._jvm.alive():
            self._drop_jvm()
        if self._jvm is None:
            self._jvm = self._pool.acquire()
        return self._jvm

    def _drop_jvm(self) -> None:
        jvm, self._jvm = self._jvm, None
        if jvm is not None:
            self._pool.discard(jvm)
