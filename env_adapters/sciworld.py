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
* **Actions.** The ReAct reply is parsed like the sibling adapters
  (:func:`env_adapters.parsing.parse_action`: text after the *last* ``Action:``, first non-empty
  line; a one-line reply without the marker is the action), lower-cased (the simulator's parser is case-insensitive), reduced to ``[a-z0-9 -]`` (drops a
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
which also computes look / inventory / every valid action combination on each step (unused by
AgentGym, and most of a step's time): same observation, score and completion.

**JVM pool.** Every ScienceWorld world lives in its own JVM (py4j; slow to start, and its heap
alone may grow to the default ``-Xmx256m``). A process-wide :class:`env_adapters.jvm.JVMPool` keeps
them: an adapter leases one on its first ``reset`` and keeps it across resets; ``close()`` hands
it back (it is not killed) and the next adapter reuses it (``load`` rebuilds the world, so a
reused JVM gives the same observations as a fresh one). At most ``size`` JVMs live at once (idle
+ leased; an ``acquire`` beyond that waits up to ``acquire_timeout_s``, then raises
:class:`InfraError`); at most ``max_idle`` are kept idle. A JVM that crashed, timed out (every
call has a read timeout) or raised is killed and dropped from the pool, and the call raises
:class:`InfraError`. :func:`shutdown_pool` kills them all (registered with ``atexit``; the JVMs
also die with this process, py4j's ``--die-on-broken-pipe``). Settings: :func:`configure_pool` or
the environment variables ``SCIWORLD_POOL_SIZE``, ``SCIWORLD_POOL_MAX_IDLE``,
``SCIWORLD_JAVA_OPTS``, ``SCIWORLD_CALL_TIMEOUT_S``, ``SCIWORLD_ACQUIRE_TIMEOUT_S``. The pool and
the lease are :mod:`env_adapters.jvm`'s, shared with the TextWorldExpress adapter.
"""

from __future__ import annotations

import atexit
from typing import Any

from scienceworld import ScienceWorldEnv

from env_adapters.base import StepResult, format_error
from env_adapters.jvm import GatewayJVM, JVMPool, JVMTextEnv, env_float, env_java_opts
from env_adapters.parsing import parse_action, simulator_command

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
    return parse_action(reply, max_chars, simulator_command)


# ---------------------------------------------------------------------------- the ScienceWorld JVM
class ScienceWorldJVM(GatewayJVM, ScienceWorldEnv):
    """``scienceworld.ScienceWorldEnv`` started our way (see :func:`env_adapters.jvm.launch_jvm`),
    poolable.

    Every ``ScienceWorldEnv`` method works on it (``load``, ``get_gold_action_sequence``,
    ``get_valid_action_object_combinations``, ...); :meth:`fast_step` is the per-step path.
    """

    def __init__(self, java_opts: list[str] | tuple[str, ...] = DEFAULT_JAVA_OPTS,
                 call_timeout_s: float = 60.0, env_step_limit: int = 100) -> None:
        from scienceworld.constants import BASEPATH, JAR_PATH

        self._launch(JAR_PATH, BASEPATH, list(java_opts), call_timeout_s,
                     lambda jvm: jvm.scienceworld.runtime.pythonapi.PythonInterface())
        # the attributes ScienceWorldEnv's methods use
        self.lastStepScore = 0
        self.taskName = None
        self.variationIdx = 0
        self.simplificationStr = ""
        self.envStepLimit = env_step_limit
        self.goldPathGenerated = False

    def fast_step(self, action: str) -> tuple[str, int, bool, int]:
        """``(observation, score 0..100 or negative, completed, moves)`` of one simulator step."""
        obs = self.server.step(action)
        score = int(round(100 * self.server.getScore()))
        return obs, score, bool(self.server.getCompleted()), int(self.server.getNumMoves())


def _make_sciworld_jvm() -> ScienceWorldJVM:
    return ScienceWorldJVM(env_java_opts("SCIWORLD_JAVA_OPTS", DEFAULT_JAVA_OPTS),
                           env_float("SCIWORLD_CALL_TIMEOUT_S", 60.0))


POOL: JVMPool[ScienceWorldJVM] = JVMPool.from_env("sciworld", _make_sciworld_jvm, "SCIWORLD")


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
                opts if opts is not None else env_java_opts("SCIWORLD_JAVA_OPTS",
                                                            DEFAULT_JAVA_OPTS),
                timeout if timeout is not None else env_float("SCIWORLD_CALL_TIMEOUT_S", 60.0))

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
class SciWorldEnv(JVMTextEnv):
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
        super().__init__(pool if pool is not None else POOL, gold_path)
        self.max_reply_chars = max_reply_chars
        self.step_limit = step_limit
        self.simplifications = simplifications
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
        self._valid = None

        def load(jvm: ScienceWorldJVM) -> tuple[str, tuple[str, int, bool, int]]:
            jvm.envStepLimit = self.step_limit
            jvm.load(task_name, variation, self.simplifications, self.gold_path)
            return jvm.get_task_description(), jvm.fast_step("look around")

        description, (look, score, completed, moves) = self._reset_on_jvm(
            f"reset of {task_name} #{variation}", load)
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
        obs, score, completed, moves = self._call_jvm(
            f"step {action!r}", lambda jvm: jvm.fast_step(action))
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
            self._valid = self._call_jvm(
                "listing valid actions",
                lambda jvm: list(jvm.get_valid_action_object_combinations()))
        return list(self._valid)

    def gold_actions(self) -> list[str]:
        """The simulator's gold action sequence for the current task (needs ``gold_path=True``)."""
        return list(self._gold_jvm().get_gold_action_sequence())

    # ------------------------------------------------------------------ internals
    def _reward(self) -> float:
        return float(min(1.0, max(0.0, self.score / 100.0)))
