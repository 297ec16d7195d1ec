"""TextWorldExpress (``textworld-express``): the fastest real text environment, for smoke tests
and benchmarks (``tests/env_adapters/test_textworld_express.py::test_latency_budget`` prints its
ms per reset and per step once the JVM is warm).

Not part of AgentGym; the adapter follows the AgentGym conventions of its siblings:

* **Game.** ``game`` is one of TextWorldExpress's games (``coin`` by default; ``cookingworld``,
  ``twc``, ``mapreader``, ``arithmetic``, ``sorting``, ``simonsays``, ``peckingorder``) and
  ``params`` its generation string as the package expects, e.g.
  ``"numLocations=5,includeDoors=0,numDistractorItems=0"`` (``""``: the game's defaults). A bad
  game or params string is a ``ValueError`` at the first reset.
* **Tasks.** ``task_id`` picks the world seed ``seeds[task_id % len(seeds)]`` of the game's
  ``split`` fold (``train``: 0..999, ``dev``: 10000..10999, ``test``: 20000..20999 for every game
  in textworld-express 1.1.0, read from the simulator). ``seed`` does not change the world (the
  world *is* the game seed); it is recorded in ``info``.
* **Observations.** The first one is the task description, a blank line, then the game's text;
  with ``show_actions`` (default) every observation ends with
  ``Available actions: ["...", ...]`` (the game's valid actions, sorted), BabyAI style.
* **Reward.** The game's normalised score (``score``, in [-1, 1]) clipped to [0, 1], reported as
  a running score (``info["reward_is_cumulative"] = True``): the rollout keeps the last value.
  ``terminated`` when the game reports success or failure (or the score reaches 1);
  ``info["success"]`` is the game's ``tasksuccess``. The package's move limit (``step_limit``,
  default 100) ends the episode as ``truncated``.
* **Actions.** The ReAct reply is parsed like SciWorld's (text after the last ``Action:``, first
  line, lower-cased, ``[a-z0-9 -]``: :mod:`env_adapters.parsing`), then given the case of the valid action it matches (the
  games compare case-sensitively: ``take TV remote control``); any parsed action is sent (``help`` repeats the task); one
  the game does not understand gets its ``Unknown action: ...`` answer and
  ``info["invalid_action"]``.

The JVMs come from a process-wide :class:`env_adapters.jvm.JVMPool` (one per concurrent
episode, reused across episodes, handed back by ``close()``; :func:`shutdown_pool` at exit).
Settings: ``TWX_POOL_SIZE``, ``TWX_POOL_MAX_IDLE``, ``TWX_JAVA_OPTS``, ``TWX_CALL_TIMEOUT_S``,
``TWX_ACQUIRE_TIMEOUT_S``. A crashed or hung JVM raises :class:`InfraError` and is discarded.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any

from textworld_express import TextWorldExpressEnv as _PackageEnv

from env_adapters.base import InfraError, StepResult, format_error
from env_adapters.jvm import GatewayJVM, JVMPool, JVMTextEnv, env_float, env_java_opts
from env_adapters.parsing import parse_action, simulator_command

GAMES = ("cookingworld", "twc", "coin", "mapreader", "arithmetic", "sorting", "simonsays",
         "peckingorder")
SPLITS = ("train", "dev", "test")
MAX_REPLY_CHARS = 2000
INVALID_ACTION_PREFIX = "Unknown action"
DEFAULT_JAVA_OPTS = ("-Xmx256m", "-XX:+UseSerialGC")

#: AgentGym-style instructions (TextWorldExpress has no AgentGym client to copy).
SYSTEM_PROMPT = (
    "You are an agent in a text-based game. Every round I will give you an observation, you "
    "have to respond an action based on the observation to finish the given task. The "
    "observation ends with the list of available actions; use one of them exactly as written, "
    "e.g. \"look around\", \"inventory\", \"move north\", \"open door to east\", "
    "\"take coin\".\nYour response should use the following format:\nThought:\nyour "
    "thoughts.\n\nAction:\nyour next action"
)
ASSISTANT_ACK = "OK. I'll follow your instructions and try my best to solve the task."


class TextWorldExpressJVM(GatewayJVM, _PackageEnv):
    """``textworld_express.TextWorldExpressEnv`` started our way, poolable."""

    def __init__(self, java_opts: list[str] | tuple[str, ...] = DEFAULT_JAVA_OPTS,
                 call_timeout_s: float = 30.0) -> None:
        from textworld_express.constants import BASEPATH, JAR_PATH

        self._launch(JAR_PATH, BASEPATH, ["-Xverify:none", *java_opts], call_timeout_s,
                     lambda jvm: jvm.textworldexpress.runtime.PythonInterface())
        self.lastStepScore = 0
        self.envStepLimit = 10**9  # the adapter applies the limit (as truncation)
        self.runHistory: list = []
        self.seed = None
        self.gameName = None
        self.gameParams = ""
        self.gameFold = "train"
        self.generateGoldPath = False
        self.goldPathGenerated = False
        self.loaded: tuple[str, str] | None = None  # (game, params) now loaded in this JVM


def _make_twx_jvm() -> TextWorldExpressJVM:
    return TextWorldExpressJVM(env_java_opts("TWX_JAVA_OPTS", DEFAULT_JAVA_OPTS),
                               env_float("TWX_CALL_TIMEOUT_S", 30.0))


POOL: JVMPool[TextWorldExpressJVM] = JVMPool.from_env("textworld", _make_twx_jvm, "TWX")

# fold seeds per (game, params, split): the same in every JVM, read once per process
_SEEDS: dict[tuple[str, str, str], list[int]] = {}
_SEEDS_LOCK = threading.Lock()


def pool_stats() -> dict[str, int]:
    return POOL.stats()


def shutdown_pool() -> None:
    """Kill every pooled TextWorldExpress JVM. Registered with ``atexit``."""
    POOL.shutdown()


atexit.register(shutdown_pool)


def _actions_suffix(actions: list[str]) -> str:
    return "\nAvailable actions: [" + ", ".join(f'"{a}"' for a in actions) + "]"


class TextWorldExpressEnv(JVMTextEnv):
    """One TextWorldExpress episode at a time on a pooled JVM."""

    name = "textworld"

    def __init__(self, game: str = "coin", params: str = "", split: str = "train",
                 step_limit: int = 100, show_actions: bool = True,
                 max_reply_chars: int = MAX_REPLY_CHARS, gold_path: bool = False,
                 pool: JVMPool | None = None) -> None:
        if game not in GAMES:
            raise ValueError(f"unknown TextWorldExpress game {game!r}; choose one of {GAMES}")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
        super().__init__(pool if pool is not None else POOL, gold_path)
        self.game, self.params, self.split = game, params, split
        self.step_limit = step_limit
        self.show_actions = show_actions
        self.max_reply_chars = max_reply_chars
        self._actions: list[str] = []

    # ------------------------------------------------------------------ TextEnv API
    def system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def valid_actions(self) -> list[str] | None:
        return list(self._actions) if self._ready and not self.done else None

    def reset(self, task_id: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
        if task_id < 0 or seed < 0:
            raise ValueError("task_id and seed must be >= 0")
        if self._closed:
            raise RuntimeError("environment is closed")

        def load(jvm: TextWorldExpressJVM) -> tuple[int, str, dict[str, Any]]:
            if jvm.loaded != (self.game, self.params):
                jvm.loaded = None
                jvm.load(self.game, self.params)  # ValueError on a bad params string
                jvm.loaded = (self.game, self.params)
            seeds = self._fold_seeds(jvm)
            world_seed = seeds[int(task_id) % len(seeds)]
            obs, infos = jvm.reset(seed=world_seed, gameFold=self.split,
                                   generateGoldPath=self.gold_path)
            return world_seed, obs, infos

        world_seed, obs, infos = self._reset_on_jvm(
            f"reset of {self.game} task {task_id}", load, caller_errors=(ValueError,))
        self.task = {"task_id": int(task_id), "seed": int(seed), "game": self.game,
                     "params": self.params, "split": self.split, "world_seed": world_seed}
        self.score = float(infos.get("score", 0.0))
        self.moves = 0
        self.done = False
        self.success = False
        self._actions = sorted(infos.get("validActions") or [])
        self._ready = True
        description = infos.get("taskDescription", "")
        observation = (description + "\n\n" + obs if description else obs) + self._suffix()
        return observation, {**self.task, "task_description": description,
                             "score": self.score, "success": False,
                             "reward_is_cumulative": True}

    def step(self, action_text: str) -> StepResult:
        if not self._ready:
            raise RuntimeError("call reset() before step()")
        base = {**self.task, "success": self.success, "invalid_action": False,
                "format_error": False, "parsed_action": None, "score": self.score,
                "moves": self.moves, "reward_is_cumulative": True}
        if self.done:
            return StepResult("The game is over.", self._reward(), True, False, base)
        action, why = parse_action(action_text, self.max_reply_chars, simulator_command)
        if action is None:
            res = format_error(
                "Invalid format: " + why + '. End your reply with a line "Action: <action>" '
                "naming one of the available actions." + self._suffix(),
                **{**base, "format_error": True})
            res.reward = self._reward()  # a running score: a bad reply does not erase progress
            return res
        # the games match actions case-sensitively ("take TV remote control"): restore the case
        action = next((a for a in self._actions if a.lower() == action), action)
        base["parsed_action"] = action
        obs, _reward, _done, infos = self._call_jvm(f"step {action!r}",
                                                    lambda jvm: jvm.step(action))
        self.moves += 1
        self.score = float(infos.get("score", 0.0))
        self.success = bool(infos.get("tasksuccess"))
        terminated = self.success or bool(infos.get("taskfailure")) or self.score >= 1.0
        truncated = not terminated and self.moves >= self.step_limit
        self.done = terminated or truncated
        self._actions = sorted(infos.get("validActions") or [])
        info = {**base, "success": self.success, "score": self.score, "moves": self.moves,
                "invalid_action": obs.startswith(INVALID_ACTION_PREFIX),
                "step_limit_reached": truncated}
        suffix = "" if self.done else self._suffix()
        return StepResult(obs + suffix, self._reward(), terminated, truncated, info)

    def gold_actions(self) -> list[str]:
        """The game's gold action sequence for the current task (needs ``gold_path=True``);
        replay it whole (most games start it with a harmless ``look around``)."""
        return list(self._gold_jvm().getGoldActionSequence())

    # ------------------------------------------------------------------ internals
    def _suffix(self) -> str:
        return _actions_suffix(self._actions) if self.show_actions else ""

    def _reward(self) -> float:
        return float(min(1.0, max(0.0, self.score)))

    def _fold_seeds(self, jvm: TextWorldExpressJVM) -> list[int]:
        key = (self.game, self.params, self.split)
        with _SEEDS_LOCK:
            seeds = _SEEDS.get(key)
        if seeds is None:
            getter = {"train": jvm.getValidSeedsTrain, "dev": jvm.getValidSeedsDev,
                      "test": jvm.getValidSeedsTest}[self.split]
            seeds = [int(s) for s in getter()]
            if not seeds:
                raise InfraError(f"textworld: no {self.split} seeds for {self.game}")
            with _SEEDS_LOCK:
                _SEEDS[key] = seeds
        return seeds
