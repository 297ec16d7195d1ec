"""Any MCP server over stdio as a tool-calling environment (``name: mcp``).

A **task file** (JSON or YAML) describes the episodes::

    {"defaults": {                                   # merged into every task (optional)
       "mcpServers": {"git": {"command": "mcp-server-git",
                              "args": ["--repository", "{workdir}"], "env": {}}},
       "env": {"GIT_AUTHOR_DATE": "2026-01-01T00:00:00+00:00", ...},
       "fixture": [{"run": "git init -q -b main"}, {"write": "README.md", "content": "..."}],
       "hidden_arguments": {"repo_path": "{workdir}"}},
     "tasks": [
       {"name": "make-branch", "category": "branch",
        "request": "Create a branch named feature/login ...",
        "fixture": [...],                            # runs after the defaults' fixture
        "checks": [{"run": "git branch --show-current", "expect": "main"},
                   {"run": "git log -1 --format=%s", "regex": "^Add "},
                   {"answer": true, "expect": "3"},
                   {"judge": "the answer explains ..."}]}]}

* ``mcpServers`` is the format MCP clients use (one server per task; ``server`` with the same
  ``{"command", "args", "env"}`` is accepted too). A command without a ``/`` is looked up next to
  this Python first (the virtualenv's ``bin``), then on ``PATH``.
* In the server's command, arguments and environment, and in ``hidden_arguments`` and ``env``,
  ``{workdir}`` is the episode's work folder, ``{episode}`` the folder that holds it,
  ``{python}`` this interpreter and ``{bin}`` its folder.
* ``env`` is added to the environment of the fixture's commands, the server and the checks'
  commands (over a minimal one: HOME, LOGNAME, PATH, SHELL, TERM, USER, as MCP's stdio client
  passes); the server's own ``env`` goes over it, for the server only.
* ``fixture`` steps prepare the work folder before the server starts: ``{"run": "shell
  command"}`` (``/bin/sh -c`` in the work folder; a non-zero exit is an ``InfraError``) or
  ``{"write": "relative/path", "content": "text"}``.
* ``hidden_arguments`` are filled in by the adapter: removed from the tools' schemas the model
  sees and injected into every call of a tool that takes them (a value the model gives is
  replaced); the schemas are shown without their ``title`` annotations (tokens that say
  nothing). Every text the model sees (results, errors, descriptions) has the work folder's
  path replaced by ``<workdir>`` (and the episode folder's by ``<episode>``); ``<workdir>`` in
  the model's string arguments is turned back into the path.
* ``checks`` run after ``submit``, once the server has stopped: ``run`` (a shell command in the
  work folder; its stdout is compared, and its exit status must be ``exit_code``, default 0,
  ``null`` for any) or ``answer: true`` (the ``answer`` given to ``submit``), with ``expect``
  (equal once both are stripped of surrounding whitespace) and/or ``regex`` (``re.search``,
  multi-line); ``judge`` (criteria for an LLM judge) calls :meth:`MCPEnv.judge_check`, a hook
  left for ``reward.judge`` that raises ``NotImplementedError`` until it is wired in.

**Reward.** ``submit`` ends the episode; the reward is 1.0 when every check passes and 0.0
otherwise, or with ``partial_credit=True`` the share of checks passed; ``success`` is always
"every check passed". An episode that never submits ends at the rollout's horizon with 0.

**Episodes.** Each ``reset`` makes a new work folder (``tempfile.mkdtemp`` under ``work_root``,
default the system's temporary folder), runs the fixture and starts the task's server in it, as
a process group of its own (MCP's ``stdio_client``); the previous episode's server is stopped
and its folder removed. The MCP client is asynchronous: each instance runs an asyncio event loop
in a thread of its own, and ``reset``/``step``/``close`` (from any thread) wait on it with
timeouts.

**Faults.** A tool's own error (an ``isError`` result) is an observation, as is a JSON-RPC error
the server answers for a call (bad parameters); an unknown tool is a ``ToolError`` observation
(the server is not asked). A server that dies, closes the connection or does not answer within
``call_timeout_s`` (or does not start within ``start_timeout_s``), a fixture or check command
that fails to run, is an ``InfraError``, and every later step of that episode raises it too:
never a reward of 0. ``close()`` stops the server (closing its stdin, then killing its process
group) and removes the work folder; no child process is left behind.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
import weakref
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import anyio
import mcp_types
import psutil
import yaml
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import get_default_environment, stdio_client
from mcp.shared.exceptions import MCPError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from env_adapters.base import InfraError, utf8_safe
from env_adapters.tool_calls import ToolCall, ToolEnv, ToolError, ToolOutcome, tool_schema

log = logging.getLogger(__name__)

T = TypeVar("T")

#: the task file used when none is given: git tasks for ``mcp-server-git``
DEFAULT_TASK_FILE = Path(__file__).parent / "data" / "mcp" / "git_tasks.json"
#: the environment variable that marks an episode's server (and everything it starts)
EPISODE_MARKER = "AGENTGYM_MCP_EPISODE"
WORKDIR_ALIAS = "<workdir>"
EPISODE_ALIAS = "<episode>"
CONNECTION_CLOSED = -32000  # JSON-RPC error code MCP's client gives a request whose connection ended


# ---------------------------------------------------------------------------------------------
# the task file


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerSpec(_Strict):
    """One MCP server, as an ``mcpServers`` entry gives it."""
    command: str
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)


class FixtureStep(_Strict):
    """A shell command run in the work folder, or a file written there."""
    run: str | None = None
    write: str | None = None
    content: str = ""

    @model_validator(mode="after")
    def _one(self) -> "FixtureStep":
        if (self.run is None) == (self.write is None):
            raise ValueError("a fixture step has exactly one of 'run' (a shell command) or 'write' (a path)")
        if self.write is not None:
            p = Path(self.write)
            if p.is_absolute() or ".." in p.parts or not p.parts:
                raise ValueError(f"fixture 'write' path {self.write!r} must be relative, inside the work folder")
        return self


class Check(_Strict):
    """One condition the episode's outcome must meet (see the module docstring)."""
    name: str = ""
    run: str | None = None
    answer: bool = False
    judge: str | None = None
    expect: str | None = None
    regex: str | None = None
    exit_code: int | None = 0

    @model_validator(mode="after")
    def _shape(self) -> "Check":
        kinds = [k for k, on in (("run", self.run is not None), ("answer", self.answer),
                                 ("judge", self.judge is not None)) if on]
        if len(kinds) != 1:
            raise ValueError("a check has exactly one of 'run' (a command), 'answer': true or 'judge' (criteria)")
        if self.answer and self.expect is None and self.regex is None:
            raise ValueError("an 'answer' check needs 'expect' or 'regex'")
        if self.judge is not None and (self.expect is not None or self.regex is not None):
            raise ValueError("a 'judge' check takes no 'expect' or 'regex'")
        if self.regex is not None:
            re.compile(self.regex)
        return self

    def label(self) -> str:
        return self.name or (f"run: {self.run}" if self.run is not None
                             else "answer" if self.answer else f"judge: {self.judge}")


def _one_server(data: Any) -> Any:
    """``mcpServers: {name: spec}`` (exactly one) -> ``server: spec``."""
    if isinstance(data, dict) and "mcpServers" in data:
        data = dict(data)
        servers = data.pop("mcpServers")
        if "server" in data:
            raise ValueError("give 'mcpServers' or 'server', not both")
        if not isinstance(servers, dict) or len(servers) != 1:
            raise ValueError("'mcpServers' must name exactly one server (one server per task)")
        data["server"] = next(iter(servers.values()))
    return data


class TaskDefaults(_Strict):
    server: ServerSpec | None = None
    env: dict[str, str] = Field(default_factory=dict)
    fixture: list[FixtureStep] = Field(default_factory=list)
    hidden_arguments: dict[str, Any] = Field(default_factory=dict)

    _servers = model_validator(mode="before")(_one_server)


class TaskSpec(TaskDefaults):
    name: str
    category: str | None = None
    request: str = Field(min_length=1)
    checks: list[Check] = Field(min_length=1)


class TaskFile(_Strict):
    description: str = ""
    defaults: TaskDefaults = Field(default_factory=TaskDefaults)
    tasks: list[TaskSpec] = Field(min_length=1)


class MCPTask(_Strict):
    """A task with the defaults merged in: what one episode needs."""
    name: str
    category: str
    request: str
    server: ServerSpec
    env: dict[str, str]
    fixture: list[FixtureStep]
    hidden_arguments: dict[str, Any]
    checks: list[Check]


def load_tasks(path: str | os.PathLike[str]) -> list[MCPTask]:
    """The tasks of a task file (JSON or YAML), defaults merged in; ``ValueError`` naming the
    file and the problem for a malformed one."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        raw = yaml.safe_load(text)  # YAML is a superset of JSON
        parsed = TaskFile.model_validate(raw)
    except (yaml.YAMLError, ValidationError) as e:
        raise ValueError(f"MCP task file {path}: {e}") from None
    d = parsed.defaults
    tasks: list[MCPTask] = []
    for i, t in enumerate(parsed.tasks):
        server = t.server or d.server
        if server is None:
            raise ValueError(f"MCP task file {path}: task {i} ({t.name}) names no server "
                             "(mcpServers, in the task or in defaults)")
        tasks.append(MCPTask(
            name=t.name, category=t.category or "mcp", request=t.request, server=server,
            env={**d.env, **t.env}, fixture=[*d.fixture, *t.fixture],
            hidden_arguments={**d.hidden_arguments, **t.hidden_arguments}, checks=t.checks))
    return tasks


def resolve_task_file(task_file: str | os.PathLike[str] | None) -> Path:
    """``task_file`` as given if it exists, else relative to the project's root (a config run
    from elsewhere); None: the packaged git tasks."""
    if task_file is None:
        return DEFAULT_TASK_FILE
    p = Path(task_file).expanduser()
    if p.exists() or p.is_absolute():
        return p
    alt = Path(__file__).resolve().parent.parent / p
    return alt if alt.exists() else p


# ---------------------------------------------------------------------------------------------
# processes


def _kill_group(pgid: int) -> None:
    """SIGKILL every process of group ``pgid``. Only for a leader not yet reaped (its pid, hence
    the group id, cannot have been given to another process)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _marked(p: psutil.Process, token: str) -> bool:
    try:
        return p.environ().get(EPISODE_MARKER) == token
    except (psutil.Error, OSError):  # gone, a zombie, or not ours to read
        return False


def _children_marked(token: str) -> list[psutil.Process]:
    """This process's children whose environment carries ``EPISODE_MARKER=token``."""
    return [p for p in psutil.Process().children() if _marked(p, token)]


def kill_episode(token: str, leader: int | None = None) -> None:
    """SIGKILL every process of an episode: the group of ``leader`` (the server) while it is
    still the episode's, then every process on the machine whose environment carries
    ``EPISODE_MARKER=token`` (what the server, the fixture and the checks started, wherever it
    went: another group, another parent)."""
    if leader is not None:
        try:
            if _marked(psutil.Process(leader), token):
                _kill_group(leader)
        except psutil.Error:
            pass
    for p in psutil.process_iter():
        if _marked(p, token):
            try:
                p.kill()
            except psutil.Error:
                pass


def run_shell(command: str, cwd: str, env: dict[str, str], timeout_s: float) -> tuple[int, str, str]:
    """``/bin/sh -c command`` in a process group of its own; (exit status, stdout, stderr).
    ``InfraError`` when it cannot start or outlives ``timeout_s`` (its group is then killed)."""
    try:
        proc = subprocess.Popen(["/bin/sh", "-c", command], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    except OSError as e:
        raise InfraError(f"mcp: cannot run {command!r}: {e}") from e
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)  # not reaped yet: the group is still this command's
        proc.communicate()
        raise InfraError(f"mcp: {command!r} did not finish within {timeout_s} s") from None
    return proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


def _abandon(loop: "_LoopThread", token: str, episode: str) -> None:
    """What close() would do, for an instance garbage-collected (or alive at exit) without it:
    kill the episode's processes, remove its folder, stop its event loop."""
    kill_episode(token)
    shutil.rmtree(episode, ignore_errors=True)
    if loop.alive():
        loop.loop.call_soon_threadsafe(loop.loop.stop)


class _LoopThread:
    """An asyncio event loop running in a daemon thread of its own; coroutines are submitted
    from any thread and waited on with a timeout."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            try:
                pending = asyncio.all_tasks(self.loop)
                for task in pending:
                    task.cancel()
                if pending:
                    self.loop.run_until_complete(asyncio.wait(pending, timeout=10))
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
                self.loop.run_until_complete(self.loop.shutdown_default_executor())
            except Exception:  # noqa: BLE001 - closing down; nothing left to report it to
                log.debug("mcp: event loop shutdown", exc_info=True)
            finally:
                self.loop.close()

    def alive(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run ``coro`` on the loop; ``TimeoutError`` (the coroutine cancelled) past ``timeout_s``."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout_s)
        except TimeoutError:
            fut.cancel()
            raise

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)


class _Server:
    """One MCP server process and its ``ClientSession``, owned by one task on a ``_LoopThread``
    (anyio's task groups must be entered and left by the same task)."""

    def __init__(self, loop: _LoopThread, params: StdioServerParameters, errlog: str, token: str) -> None:
        self._loop = loop
        self._params = params
        self._errlog_path = errlog
        self._token = token
        self.pid: int | None = None
        self.session: ClientSession | None = None
        self.tools: list[Any] = []
        self._owner: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None

    # -- on the loop

    async def _own(self, ready: asyncio.Future[None]) -> None:
        try:
            with open(self._errlog_path, "w", encoding="utf-8") as errlog:
                async with stdio_client(self._params, errlog=errlog) as (read, write):
                    for _ in range(100):  # the spawn has returned; give /proc a moment all the same
                        procs = _children_marked(self._token)
                        if procs:
                            self.pid = procs[0].pid
                            break
                        await asyncio.sleep(0.02)
                    else:
                        log.warning("mcp: the server's process was not found (its kill relies on the marker)")
                    async with ClientSession(read, write) as session:
                        await session.initialize()
                        tools: list[Any] = []
                        cursor: str | None = None
                        while True:
                            listing = await session.list_tools(
                                params=mcp_types.PaginatedRequestParams(cursor=cursor) if cursor else None)
                            tools.extend(listing.tools)
                            cursor = listing.next_cursor
                            if not cursor:
                                break
                        self.tools = tools
                        self.session = session
                        if not ready.done():
                            ready.set_result(None)
                        assert self._stop is not None
                        await self._stop.wait()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on `ready`
            if not ready.done():
                ready.set_exception(e if isinstance(e, Exception) else InfraError(f"server stopped: {e!r}"))
            if not isinstance(e, Exception):
                raise
        finally:
            self.session = None

    async def _start(self, timeout_s: float) -> None:
        self._stop = asyncio.Event()
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # read even after a timeout
        self._owner = asyncio.ensure_future(self._own(ready))
        await asyncio.wait_for(asyncio.shield(ready), timeout_s)

    async def _call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> Any:
        if self.session is None or self._owner is None or self._owner.done():
            raise InfraError("the MCP server's connection is closed")
        with anyio.fail_after(timeout_s):
            return await self.session.call_tool(name, arguments)

    async def _shutdown(self, grace_s: float) -> None:
        owner = self._owner
        if owner is None or owner.done():
            return
        if self._stop is not None:
            self._stop.set()
        if self.session is None:  # still starting: nothing waits on the stop event yet
            owner.cancel()
        done, _ = await asyncio.wait({owner}, timeout=grace_s)
        if not done:
            kill_episode(self._token, self.pid)
            owner.cancel()
            await asyncio.wait({owner}, timeout=grace_s)

    # -- from any thread

    def start(self, timeout_s: float) -> None:
        self._loop.run(self._start(timeout_s), timeout_s + 10)

    def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> Any:
        return self._loop.run(self._call(name, arguments, timeout_s), timeout_s + 10)

    def alive(self) -> bool:
        if self._owner is None or self._owner.done() or self.session is None:
            return False
        if self.pid is None:
            return True
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def stop(self, kill_first: bool = False, grace_s: float = 8.0) -> None:
        """Close the session and stdin (the server exits), kill the group if it does not; with
        ``kill_first`` (a dead or hung server) kill at once. Never raises."""
        if kill_first:
            kill_episode(self._token, self.pid)
        if self._loop.alive():
            try:
                self._loop.run(self._shutdown(grace_s), 2 * grace_s + 10)
            except Exception:  # noqa: BLE001 - the group kill below is the backstop
                log.warning("mcp: the server's session did not close cleanly", exc_info=True)
        kill_episode(self._token, self.pid)  # whatever outlived it

    def stderr_tail(self, chars: int = 800) -> str:
        try:
            return Path(self._errlog_path).read_text(encoding="utf-8", errors="replace")[-chars:].strip()
        except OSError:
            return ""


# ---------------------------------------------------------------------------------------------
# the environment


def _content_text(result: Any) -> str:
    """A ``CallToolResult``'s content as text (non-text blocks named, not inlined)."""
    parts: list[str] = []
    for block in getattr(result, "content", None) or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(str(block.text))
        elif kind == "resource":
            res = block.resource
            parts.append(str(res.text) if hasattr(res, "text") else f"[resource {res.uri}]")
        elif kind == "resource_link":
            parts.append(f"[resource link {block.uri}]")
        else:
            parts.append(f"[{kind or 'content'} omitted]")
    structured = getattr(result, "structured_content", None)
    if not parts and structured is not None:
        parts.append(json.dumps(structured, ensure_ascii=False, sort_keys=True))
    return "\n".join(parts)


def _map_strings(value: Any, fn: Any) -> Any:
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    if isinstance(value, dict):
        return {(fn(k) if isinstance(k, str) else k): _map_strings(v, fn) for k, v in value.items()}
    return value


def _without_titles(schema: Any) -> Any:
    """A JSON schema without its ``title`` annotations (pydantic's "Repo Path" for repo_path:
    prompt tokens that say nothing); a property *named* title stays."""
    if isinstance(schema, list):
        return [_without_titles(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(value, dict):
            out[key] = {name: _without_titles(sub) for name, sub in value.items()}
        else:
            out[key] = _without_titles(value)
    return out


class MCPEnv(ToolEnv):
    """Tasks of a task file played against their MCP server (module docstring)."""

    name = "mcp"
    SUBMIT = "submit"

    def __init__(self, task_file: str | None = None, work_root: str | None = None,
                 call_timeout_s: float = 30.0, start_timeout_s: float = 60.0,
                 command_timeout_s: float = 60.0, partial_credit: bool = False,
                 max_result_chars: int = 4000) -> None:
        for key, v in (("call_timeout_s", call_timeout_s), ("start_timeout_s", start_timeout_s),
                       ("command_timeout_s", command_timeout_s), ("max_result_chars", max_result_chars)):
            if not v > 0:
                raise ValueError(f"mcp env: {key} must be > 0, got {v}")
        self.task_file = resolve_task_file(task_file)
        self.tasks = load_tasks(self.task_file)
        for t in self.tasks:
            self._command(t.server.command)  # a missing server program fails here, not mid-run
        self.work_root = work_root
        self.call_timeout_s = float(call_timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.command_timeout_s = float(command_timeout_s)
        self.partial_credit = bool(partial_credit)
        self.max_result_chars = int(max_result_chars)
        self._lock = threading.RLock()
        self._loop: _LoopThread | None = None
        self._server: _Server | None = None
        self._task: MCPTask | None = None
        self._episode: str | None = None
        self._workdir: str | None = None
        self._token: str | None = None
        self._tools: list[dict[str, Any]] = []
        self._inject: dict[str, dict[str, Any]] = {}
        self._scrubs: list[tuple[str, str]] = []
        self._broken: str | None = None
        self._done = True
        self._finalizer: weakref.finalize | None = None

    # -- public surface

    def system_prompt(self) -> str:
        return ("You complete the user's request by calling tools. Call a tool with a block "
                '<tool_call>{"name": "tool_name", "arguments": {...}}</tool_call>; a reply may hold '
                "several calls, and each call's result comes back to you. When the request is done, "
                f"call {self.SUBMIT} (with your answer in its \"answer\" argument when the request asks "
                "a question): that ends the episode and your work is checked.")

    @property
    def server_pid(self) -> int | None:
        """The current episode's server process (None between episodes)."""
        return self._server.pid if self._server is not None else None

    @property
    def episode_token(self) -> str | None:
        """The value of ``AGENTGYM_MCP_EPISODE`` in the environment of the current episode's
        server and of everything it starts (to find them)."""
        return self._token

    @property
    def workdir(self) -> str | None:
        return self._workdir

    def tools(self) -> list[dict[str, Any]]:
        return [*self._tools, self._submit_tool()]

    def valid_actions(self) -> list[str] | None:
        """Calls that need no argument (the random-valid baseline's choices), ``submit`` last."""
        if self._done:
            return None
        calls = [t["function"]["name"] for t in self._tools
                 if not t["function"]["parameters"].get("required")] + [self.SUBMIT]
        return [f'<tool_call>\n{json.dumps({"name": n, "arguments": {}})}\n</tool_call>' for n in calls]

    def _reset(self, task_id: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
        if not 0 <= int(task_id) < len(self.tasks):
            raise ValueError(f"mcp env: task {task_id} is not in {self.task_file} "
                             f"({len(self.tasks)} tasks: 0..{len(self.tasks) - 1})")
        with self._lock:
            self._end_episode()
            task = self.tasks[int(task_id)]
            self._task, self._broken, self._done = task, None, False
            try:
                self._start_episode(task)
            except BaseException:
                self._end_episode()
                raise
            return task.request, {"task_id": int(task_id), "task_name": task.name, "category": task.category,
                                  "seed": seed}

    def call_tool(self, call: ToolCall) -> ToolOutcome:
        with self._lock:
            if self._done or self._task is None:
                raise ToolError("the episode is over: no more calls")
            if self._broken:
                raise InfraError(self._broken)
            if call.name == self.SUBMIT:
                return self._submit(call.arguments)
            names = [t["function"]["name"] for t in self._tools]
            if call.name not in self._inject:
                raise ToolError(f"unknown tool {utf8_safe(call.name)[:80]!r}; the tools are: "
                                + ", ".join([*names, self.SUBMIT]))
            args = _map_strings(call.arguments, lambda s: self._unscrub(utf8_safe(s)))
            args.update(self._inject[call.name])
            assert self._server is not None
            try:
                result = self._server.call(call.name, args, self.call_timeout_s)
            except MCPError as e:
                if e.code != CONNECTION_CLOSED and self._server.alive():  # the server refused the call
                    raise ToolError(self._scrub(e.message)) from None
                self._fail(f"the MCP server died or closed its connection during {call.name} ({e.message})")
            except TimeoutError:
                self._fail(f"the MCP server did not answer {call.name} within {self.call_timeout_s} s")
            except Exception as e:  # noqa: BLE001 - the transport's faults: closed streams, broken pipes
                self._fail(f"the MCP server died or closed its connection during {call.name} "
                           f"({type(e).__name__}: {e})")
            text = self._scrub(_content_text(result)) or "(no output)"
            if len(text) > self.max_result_chars:
                text = text[:self.max_result_chars] + f"\n[... {len(text) - self.max_result_chars} more characters]"
            is_error = bool(getattr(result, "is_error", False))
            if is_error and not text.lower().startswith("error"):
                text = f"Error: {text}"
            return ToolOutcome(text, info={"tool_error": True} if is_error else {})

    def judge_check(self, check: Check, answer: str) -> bool:
        """Whether the episode meets a ``judge`` check's criteria: a hook for the LLM judge."""
        raise NotImplementedError(
            f"mcp env: task {self._task.name if self._task else '?'} has a 'judge' check "
            f"({check.label()!r}), which needs the LLM judge of reward.judge (agentgym/rewards/judge*.py) "
            "wired into MCPEnv.judge_check; it is not, so use 'run' or 'answer' checks")

    def close(self) -> None:
        with self._lock:
            self._end_episode()
            if self._loop is not None:
                self._loop.stop()
                self._loop = None

    # -- episodes

    def _submit_tool(self) -> dict[str, Any]:
        return tool_schema(self.SUBMIT, "Finish: call it once the request is done. It ends the episode, "
                           "and your work is then checked.", {
                               "type": "object", "properties": {"answer": {
                                   "type": "string",
                                   "description": "Your answer, when the request asks a question."}},
                               "required": []})

    def _command(self, command: str) -> str:
        if "/" in command:
            return command
        here = Path(sys.executable).parent / command
        if here.is_file() and os.access(here, os.X_OK):
            return str(here)
        found = shutil.which(command)
        if found is None:
            raise FileNotFoundError(f"mcp env: the server program {command!r} is neither next to "
                                    f"{sys.executable} nor on PATH (install it: pip install ...)")
        return found

    def _fill(self, text: str) -> str:
        assert self._workdir is not None and self._episode is not None
        return (text.replace("{workdir}", self._workdir).replace("{episode}", self._episode)
                .replace("{python}", sys.executable).replace("{bin}", str(Path(sys.executable).parent)))

    def _scrub(self, text: str) -> str:
        for path, alias in self._scrubs:
            text = text.replace(path, alias)
        return text

    def _unscrub(self, text: str) -> str:
        if self._workdir is not None and WORKDIR_ALIAS in text:
            text = text.replace(WORKDIR_ALIAS, self._workdir)
        return text

    def _env(self, task: MCPTask) -> dict[str, str]:
        """The fixture's and the checks' environment (marked as the episode's)."""
        assert self._token is not None
        return {**get_default_environment(), **{k: self._fill(v) for k, v in task.env.items()},
                EPISODE_MARKER: self._token}

    def _start_episode(self, task: MCPTask) -> None:
        root = self.work_root or tempfile.gettempdir()
        os.makedirs(root, exist_ok=True)
        self._episode = tempfile.mkdtemp(prefix="agentgym-mcp-", dir=root)
        self._workdir = os.path.join(self._episode, "work")
        os.mkdir(self._workdir)
        pairs = {self._workdir: WORKDIR_ALIAS, os.path.realpath(self._workdir): WORKDIR_ALIAS,
                 self._episode: EPISODE_ALIAS, os.path.realpath(self._episode): EPISODE_ALIAS}
        self._scrubs = sorted(pairs.items(), key=lambda kv: -len(kv[0]))
        self._token = uuid.uuid4().hex
        env = self._env(task)
        for step in task.fixture:
            if step.write is not None:
                target = Path(self._workdir, step.write)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(step.content, encoding="utf-8")
                continue
            assert step.run is not None
            rc, out, err = run_shell(step.run, self._workdir, env, self.command_timeout_s)
            if rc != 0:
                raise InfraError(f"mcp task {task.name}: fixture command {step.run!r} exited {rc}: "
                                 f"{(err or out).strip()[-500:]}")
        params = StdioServerParameters(
            command=self._command(self._fill(task.server.command)),
            args=[self._fill(a) for a in task.server.args],
            env={**{k: self._fill(v) for k, v in task.env.items()},
                 **{k: self._fill(v) for k, v in task.server.env.items()}, EPISODE_MARKER: self._token},
            cwd=self._workdir)
        if self._loop is None or not self._loop.alive():
            self._loop = _LoopThread(f"mcp-env-{id(self):x}")
        self._server = _Server(self._loop, params, os.path.join(self._episode, "server.log"), self._token)
        # a backstop for an instance dropped without close(): at garbage collection or exit
        self._finalizer = weakref.finalize(self, _abandon, self._loop, self._token, self._episode)
        try:
            self._server.start(self.start_timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure to start is the infrastructure's
            self._broken = "the server did not start"  # stopped with a kill, not a grace period
            what = ("did not start within " f"{self.start_timeout_s} s" if isinstance(e, TimeoutError)
                    else f"failed to start: {type(e).__name__}: {e}")
            raise InfraError(f"mcp task {task.name}: the server {task.server.command!r} {what}; "
                             f"its stderr: {self._server.stderr_tail()!r}") from e
        hidden = {k: _map_strings(v, self._fill) for k, v in task.hidden_arguments.items()}
        self._tools, self._inject = [], {}
        for tool in self._server.tools:
            if tool.name == self.SUBMIT:
                raise ValueError(f"mcp task {task.name}: the server has its own {self.SUBMIT!r} tool")
            schema = copy.deepcopy(dict(tool.input_schema or {"type": "object", "properties": {}}))
            schema.setdefault("type", "object")
            props = schema.setdefault("properties", {})
            self._inject[tool.name] = {k: v for k, v in hidden.items() if k in props}
            for k in self._inject[tool.name]:
                del props[k]
            if "required" in schema:
                schema["required"] = [r for r in schema["required"] if r not in hidden]
            schema = json.loads(self._scrub(json.dumps(_without_titles(schema), ensure_ascii=False)))
            self._tools.append(tool_schema(tool.name, self._scrub(tool.description or ""), schema))

    def _fail(self, why: str) -> NoReturn:
        assert self._task is not None and self._server is not None
        tail = self._server.stderr_tail()
        self._broken = f"mcp task {self._task.name}: {why}" + (f"; its stderr: {tail!r}" if tail else "")
        raise InfraError(self._broken)

    def _submit(self, arguments: dict[str, Any]) -> ToolOutcome:
        answer = arguments.get("answer", "")
        if not isinstance(answer, str):
            raise ToolError('"answer" must be a string')
        task = self._task
        assert task is not None and self._server is not None and self._workdir is not None
        if not self._server.alive():
            self._fail("the MCP server died or closed its connection before submit")
        self._server.stop()  # its writes are done before anything is checked
        self._server = None
        results = [(c.label(), self._check(task, c, utf8_safe(answer))) for c in task.checks]
        passed = sum(ok for _, ok in results)
        success = passed == len(results)
        reward = passed / len(results) if self.partial_credit else float(success)
        self._done = True
        return ToolOutcome("Submitted: the episode is over.", done=True, reward=float(reward), success=success,
                           info={"checks": [{"check": label, "passed": ok} for label, ok in results],
                                 "checks_passed": passed, "checks_total": len(results)})

    def _check(self, task: MCPTask, check: Check, answer: str) -> bool:
        if check.judge is not None:
            return bool(self.judge_check(check, answer))
        if check.run is not None:
            assert self._workdir is not None
            rc, subject, _ = run_shell(check.run, self._workdir, self._env(task), self.command_timeout_s)
            if check.exit_code is not None and rc != check.exit_code:
                return False
        else:
            subject = answer
        if check.expect is not None and subject.strip() != check.expect.strip():
            return False
        return check.regex is None or re.search(check.regex, subject, re.MULTILINE) is not None

    def _end_episode(self) -> None:
        """Stop the server (killing at once when it is dead or hung) and remove the folder."""
        if self._server is not None:
            self._server.stop(kill_first=self._broken is not None)
            self._server = None
        if self._token is not None:
            kill_episode(self._token)  # anything a fixture or check command left running
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._episode is not None:
            shutil.rmtree(self._episode, ignore_errors=True)
        self._episode = self._workdir = self._token = None
        self._tools, self._inject, self._scrubs = [], {}, []
        self._done = True
