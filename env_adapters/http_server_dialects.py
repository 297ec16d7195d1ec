"""What ``agentgym env serve`` reads from a request and what it answers, per dialect.

AgentGym's environment servers do not share one schema: each ``agentenv-<env>`` package has its
own request bodies and answers, and AgentGym's client classes (``agentenv/envs/<env>.py``, which
AgentGym-RL trains with) read exactly those. A server answers in one of these dialects:

============  ===================================================================================
dialect       what a request names and what each route answers
============  ===================================================================================
agentgym      this project's protocol (``env_adapters.http_client``'s default dialect): the
              instance is ``id``, the task ``data_idx``; ``/create`` -> ``{"id"}``; ``/reset``
              -> ``{"id", "observation", "reward", "done", "info", "system_prompt"?, "tools"?}``
              (``tools``: a tool environment's schemas);
              ``/step`` -> ``{"observation", "reward", "done", "terminated", "truncated",
              "info"}``; ``GET /observation`` -> the observation (a string); ``/close`` ->
              ``{"id", "closed": true}``.
babyai        ``agentenv-babyai``: ``/create`` -> ``{"id"}``; ``/reset {id, data_idx}`` ->
              ``{"observation", "reward", "score", "deleted", "done"}``; ``/step {id, action}``
              -> ``{"observation", "reward", "score", "done"}`` (``score``: the running sum of
              the episode's rewards, as AgentGym's server adds them); ``GET /observation?id=``
              -> ``{"observation", "reward", "score", "done", "deleted"}``; ``/close`` -> ``true``.
textcraft     ``agentenv-textcraft``: ``/create {commands?, goal?}`` -> ``{"id", "observation",
              "done", "reward"}`` (the new instance is reset to task 0, so it has a first
              observation); ``/reset {id, data_idx}`` -> ``{"id", "observation", "done",
              "reward"}``; ``/step`` -> ``{"observation", "reward", "done"}``; ``GET
              /observation?id=`` -> a string; ``/close`` -> ``true``. Custom ``commands`` /
              ``goal`` at ``/create`` are refused (tasks come from ``data_idx``).
sciworld      ``agentenv-sciworld``: ``/create`` -> ``{"id"}``; ``/reset {id, data_idx}`` ->
              ``{"task_name", "var_num", "task_description", "observation", "reward", "score",
              "deleted", "done"}`` (``observation``: the first ``look around`` without the task
              description, which has its own field); ``/step`` -> ``{"observation", "reward",
              "score", "done"}`` in ScienceWorld's units (``score`` 0..100, ``reward`` its
              change); ``GET /observation?id=`` -> a string; ``GET /task_description?id=`` ->
              ``{"task_description"}``; ``/close`` -> ``true``.
deepsearch    ``agentenv-searchqa``: the instance is ``env_idx`` everywhere and ``id`` is the
              *question* index (``/create`` and ``/reset`` only); ``/create {id}`` -> the
              instance as a bare integer (reset to question ``id``); ``/reset {env_idx, id}`` ->
              the observation as a bare string; ``/step {env_idx, action}`` -> ``{"observation",
              "reward", "done", "info": null}``; ``GET /observation?env_idx=`` -> a string;
              ``/close {env_idx}`` -> ``true``.
============  ===================================================================================

A server's default dialect is the environment's AgentGym dialect (:data:`NATIVE`; ``agentgym``
for environments AgentGym has no server for), so AgentGym's own clients work unchanged. A
request may ask for another dialect with the :data:`DIALECT_HEADER` header; this project's client
sends ``agentgym`` there, so it works against every server whatever its default.

**A request cannot change an instance it does not name.** Each dialect has exactly one key that
names the instance (``instance_key``); a request that also carries another instance key
(``id`` / ``env_idx`` / ``env_id``, where that key is not the dialect's task field on that
route) is ambiguous and refused with HTTP 400 before anything runs. So the Deep Search request
``/reset {"env_idx": 2, "id": 3}`` resets instance 2 to question 3, and ``{"id": 3}`` alone is a
400 in that dialect, never a reset of instance 3. Instance ids are drawn at random from a large
range (``http_server.EnvPool``), so a task index sent where an instance belongs names no
instance at all (``unknown_id``) rather than someone else's.

AgentGym routes not served: BabyAI's ``/render``, SciWorld's ``/step_visual``, ``/action_hint``,
``/goals``, ``/object_tree`` and ``/state``, TextCraft's ``/commands`` and ``/goal`` (visual
tools; the last two fail on AgentGym's own server too, its wrapper lacks the methods).
"""

from __future__ import annotations

from typing import Any

#: request header choosing the dialect of that request (overrides the server's default)
DIALECT_HEADER = "X-AgentGym-Dialect"
#: body / query keys that name an instance in some dialect
INSTANCE_KEYS = ("id", "env_idx", "env_id")


class EnvRequestError(Exception):
    """A request the server refuses; ``code`` goes into the error payload, ``status`` is the HTTP
    status (200 for protocol errors, as AgentGym answers them; 400 for a request that does not
    name exactly one instance, where AgentGym's servers answer 422 for a missing field)."""

    def __init__(self, message: str, code: str, status: int = 200):
        super().__init__(message)
        self.code = code
        self.status = status


def int_field(body: dict[str, Any], *names: str, default: Any = ...) -> int:
    """The first of ``names`` present in ``body`` as an integer (an int or a numeric string)."""
    for name in names:
        if name in body and body[name] is not None:
            value = body[name]
            if isinstance(value, (int, str)) and not isinstance(value, bool):
                try:
                    return int(value)
                except ValueError:
                    pass
            # present but not an integer: an error, never a silent fall back to the default task
            raise EnvRequestError(f"field {name!r} must be an integer, got {value!r}", "bad_request")
    if default is not ...:
        return default
    raise EnvRequestError(f"missing or non-integer field {names[0]!r}", "bad_request")


class ServerDialect:
    """The ``agentgym`` dialect; subclasses override what differs. Answers are built from the
    server's record of an instance (``http_server._Slot``): ``observation``, ``reward`` (last
    step's), ``episode_return``, ``done``, ``info`` (last reset's or step's), ``system_prompt``."""

    name = "agentgym"
    instance_key = "id"
    task_keys: tuple[str, ...] = ("data_idx", "idx", "task_id")
    #: routes on which ``id`` is the task, not an instance (Deep Search)
    task_id_routes: frozenset[str] = frozenset()
    #: the task a new instance is reset to at ``/create`` (None: not reset until ``/reset``)
    def create_task(self, body: dict[str, Any]) -> int | None:
        return None

    def instance(self, fields: dict[str, Any], route: str) -> int:
        """The instance a request names (body or query string); HTTP 400 when another instance
        key is present too."""
        others = [k for k in INSTANCE_KEYS if k != self.instance_key and fields.get(k) is not None
                  and not (k == "id" and route in self.task_id_routes)]
        if others:
            raise EnvRequestError(
                f"the {self.name} dialect names the instance with {self.instance_key!r} only; this "
                f"/{route} request also carries {', '.join(repr(k) for k in others)}, which could name "
                f"another instance. Send only {self.instance_key!r} (or pick the dialect you speak with "
                f"the {DIALECT_HEADER} header).", "bad_request", status=400)
        if fields.get(self.instance_key) is None:
            raise EnvRequestError(f"the {self.name} dialect names the instance with {self.instance_key!r}; "
                                  f"the /{route} request has none", "bad_request", status=400)
        try:
            return int_field(fields, self.instance_key)
        except EnvRequestError as e:  # not an integer: it names no instance either
            raise EnvRequestError(str(e), e.code, status=400) from None

    def task(self, body: dict[str, Any]) -> int:
        return int_field(body, *self.task_keys, default=0)

    def seed(self, body: dict[str, Any]) -> int:
        return int_field(body, "seed", default=0)

    # -- answers ------------------------------------------------------------------------------
    def create_answer(self, env_id: int, slot: Any) -> Any:
        return {"id": env_id}

    def reset_answer(self, env_id: int, slot: Any) -> Any:
        out = {"id": env_id, "observation": slot.observation, "reward": 0.0, "done": False,
               "info": slot.info}
        if isinstance(slot.system_prompt, str):  # spares HTTPEnv a GET /system_prompt per episode
            out["system_prompt"] = slot.system_prompt
        if slot.tools is not None:  # a tool environment: the episode's tools (GET /tools)
            out["tools"] = slot.tools
        return out

    def step_answer(self, slot: Any, terminated: bool, truncated: bool) -> Any:
        return {"observation": slot.observation, "reward": slot.reward, "done": slot.done,
                "terminated": terminated, "truncated": truncated, "info": slot.info}

    def observation_answer(self, slot: Any) -> Any:
        return slot.observation

    def close_answer(self, env_id: int) -> Any:
        return {"id": env_id, "closed": True}


class BabyAIServerDialect(ServerDialect):
    name = "babyai"
    task_keys = ("data_idx",)

    def seed(self, body: dict[str, Any]) -> int:
        return 0  # AgentGym's data_idx carries the minigrid seed

    def reset_answer(self, env_id: int, slot: Any) -> Any:
        return {"observation": slot.observation, "reward": 0.0, "score": 0.0, "deleted": False,
                "done": False}

    def step_answer(self, slot: Any, terminated: bool, truncated: bool) -> Any:
        return {"observation": slot.observation, "reward": slot.reward, "score": slot.episode_return,
                "done": slot.done}

    def observation_answer(self, slot: Any) -> Any:
        return {"observation": slot.observation, "reward": slot.reward, "score": slot.episode_return,
                "done": slot.done, "deleted": False}

    def close_answer(self, env_id: int) -> Any:
        return True


class TextCraftServerDialect(ServerDialect):
    name = "textcraft"
    task_keys = ("data_idx",)

    def seed(self, body: dict[str, Any]) -> int:
        return 0

    def create_task(self, body: dict[str, Any]) -> int | None:
        if body.get("commands") is not None or body.get("goal") is not None:
            raise EnvRequestError("custom crafting commands / goal are not served: create without them "
                                  "and reset to a task with data_idx", "bad_request")
        return 0

    def create_answer(self, env_id: int, slot: Any) -> Any:
        return {"id": env_id, "observation": slot.observation, "done": False, "reward": 0}

    def reset_answer(self, env_id: int, slot: Any) -> Any:
        return {"id": env_id, "observation": slot.observation, "done": False, "reward": 0}

    def step_answer(self, slot: Any, terminated: bool, truncated: bool) -> Any:
        return {"observation": slot.observation, "reward": slot.reward, "done": slot.done}

    def close_answer(self, env_id: int) -> Any:
        return True


class SciWorldServerDialect(ServerDialect):
    name = "sciworld"
    task_keys = ("data_idx",)

    def seed(self, body: dict[str, Any]) -> int:
        return 0

    @staticmethod
    def _description(slot: Any) -> str:
        return str(slot.info.get("task_description") or "")

    def reset_answer(self, env_id: int, slot: Any) -> Any:
        desc = self._description(slot)
        look = slot.observation.removeprefix(desc + "\n") if desc else slot.observation
        return {"task_name": slot.info.get("task_name"), "var_num": slot.info.get("variation"),
                "task_description": desc, "observation": look, "reward": 0.0,
                "score": slot.info.get("score", 0), "deleted": False, "done": False}

    def step_answer(self, slot: Any, terminated: bool, truncated: bool) -> Any:
        score = slot.info.get("score", 0)
        return {"observation": slot.observation, "reward": score - slot.previous_score, "score": score,
                "done": slot.done}

    def task_description_answer(self, slot: Any) -> Any:
        return {"task_description": self._description(slot)}

    def close_answer(self, env_id: int) -> Any:
        return True


class DeepSearchServerDialect(ServerDialect):
    name = "deepsearch"
    instance_key = "env_idx"
    task_keys = ("id",)
    task_id_routes = frozenset({"create", "reset"})

    def seed(self, body: dict[str, Any]) -> int:
        return 0

    def task(self, body: dict[str, Any]) -> int:
        return int_field(body, "id")  # AgentGym's server cannot reset without a question either

    def create_task(self, body: dict[str, Any]) -> int | None:
        return int_field(body, "id", default=0)

    def create_answer(self, env_id: int, slot: Any) -> Any:
        return env_id

    def reset_answer(self, env_id: int, slot: Any) -> Any:
        return slot.observation

    def step_answer(self, slot: Any, terminated: bool, truncated: bool) -> Any:
        return {"observation": slot.observation, "reward": slot.reward, "done": slot.done, "info": None}

    def close_answer(self, env_id: int) -> Any:
        return True


DIALECTS: dict[str, ServerDialect] = {
    d.name: d for d in (ServerDialect(), BabyAIServerDialect(), TextCraftServerDialect(),
                        SciWorldServerDialect(), DeepSearchServerDialect())}
#: each environment's AgentGym dialect: a server's default (others default to ``agentgym``)
NATIVE = {"babyai": "babyai", "textcraft": "textcraft", "sciworld": "sciworld", "deepsearch": "deepsearch"}


def default_dialect(env_name: str, dialect: str | None = None) -> ServerDialect:
    """The dialect a server for ``env_name`` answers in: ``dialect`` by name, or (None /
    ``"native"``) the environment's AgentGym one."""
    name = NATIVE.get(env_name, "agentgym") if dialect in (None, "native") else dialect
    if name not in DIALECTS:
        raise ValueError(f"unknown dialect {dialect!r}; choose native or one of {sorted(DIALECTS)}")
    return DIALECTS[name]


def request_dialect(header: str | None, default: ServerDialect) -> ServerDialect:
    """The dialect of one request: its :data:`DIALECT_HEADER` (HTTP 400 if unknown) or the server's."""
    if not header:
        return default
    if header not in DIALECTS:
        raise EnvRequestError(f"unknown dialect {header!r} in the {DIALECT_HEADER} header; this server "
                              f"speaks {sorted(DIALECTS)}", "bad_request", status=400)
    return DIALECTS[header]
