"""A :class:`TextEnv` backed by a remote AgentGym environment server (HTTP).

One ``HTTPEnv`` is one remote environment instance (one episode at a time), like every other
adapter. The remote instance is created lazily on the first :meth:`HTTPEnv.reset` (so building
the object never touches the network) and released by :meth:`HTTPEnv.close`.

AgentGym servers are not uniform; a *dialect* says how one family talks:

============  =======================================================================
dialect       protocol (what the real server expects / returns)
============  =======================================================================
agentgym      this project's server (``env_adapters.http_server``; every request carries the
              ``X-AgentGym-Dialect: agentgym`` header, so any of its servers answers in this
              form whatever its default) and the generic form:
              ``POST /create`` -> ``{"id"}``; ``POST /reset {id, data_idx, seed}`` ->
              ``{"observation", "info", "system_prompt"?, "tools"?}`` (a ``system_prompt``
              there spares the ``GET /system_prompt``; ``tools``: a tool environment's
              schemas, what :meth:`HTTPEnv.tools` returns); ``POST /step {id, action}`` ->
              ``{"observation", "reward", "done", "terminated", "truncated", "info"}`` (a tool
              environment's ``info`` carries ``tool_results`` and ``tool_calls``);
              ``GET /observation?id=``; ``POST /close {id}``. The raw model reply is sent:
              the server-side adapter parses it.
textcraft     ``POST /create {commands, goal}`` -> ``{"id", "observation", ...}``;
              ``/reset {id, data_idx}``; ``/step {id, action}`` -> ``{observation, reward,
              done}``. The action is extracted client side from ``Action: ...`` like the
              AgentGym client (two ``Action:`` lines -> a local format error, no server call).
babyai        ``POST /create`` (no body) -> ``{"id"}``; ``/reset {id, data_idx}`` and
              ``/step {id, action}`` -> ``{observation, reward, score, done}``; the text
              after ``Action:`` is sent. ``reward`` (in [0, 1]) is used; ``score`` (a running
              sum) goes to ``info``.
sciworld      as babyai; reset also returns ``task_description`` (prepended to the first
              observation). ``score`` is 0..100 (-100 on failure); the step reward is
              ``clip(score / 100, 0, 1)``, i.e. the *running* task progress, as the AgentGym
              client reports it (``info["reward_is_cumulative"] = True``).
deepsearch    Search-R1 style QA server, keyed by ``env_idx``: ``POST /create {id}`` -> a
              bare int; ``/reset {env_idx, id}`` -> the observation as a bare string;
              ``/step {env_idx, action}`` -> ``{observation, reward, done, info}``;
              ``GET /observation?env_idx=``; ``/close {env_idx}``. Raw reply is sent.
webarena      ``POST /create`` -> ``{"env_idx"}``; ``/reset {env_idx, seed, idx}`` ->
              ``{"observation"}``; ``/step {env_idx, action}`` -> ``{observation, reward,
              terminated, truncated, info}``; ``/close {env_idx}`` -> plain text. Raw reply,
              once its first ``` block parses as a WebArena action (else a local format error).
============  =======================================================================

Failure handling (see ``base.py``): a transport failure is retried with exponential backoff
(``backoff_s * 2**k``) and, once the retries are spent, raised as :class:`InfraError` naming
the URL. A request that may already have been applied by the server (a ``/step`` or
``/create`` whose response timed out or whose connection broke mid-response) is **not** resent:
resending could apply an action twice; it fails at once with ``InfraError``. Requests that
never reached the server (connection refused, connect timeout) are always retried. An HTTP 200
carrying ``{"error": ...}`` (the AgentGym convention) and any non-200 status are
``InfraError`` too, never a reward of 0. A malformed model reply never raises here: it is sent
as-is (the server decides) or, for the dialects that parse client side, becomes a format-error
observation.

Server pools: ``base_urls=[...]`` instead of ``base_url`` spreads episodes over several servers
of the same environment (``env_adapters.http_pool``: the live server with the fewest open
instances, health-checked). The server is chosen when the episode's instance is created; a
server that cannot take it (unreachable, at capacity) is skipped for the next one, since the
episode has not started. A transport failure marks the server down for every episode of the
process; the episodes already on it end as ``InfraError`` (their state lives on that server).
"""

from __future__ import annotations

import logging
import math
import re
import time
from typing import Any

import httpx

from env_adapters.base import InfraError, StepResult, TextEnv, format_error, utf8_safe
from env_adapters.http_pool import ServerPool, pool_for
from env_adapters.http_server_dialects import DIALECT_HEADER
from env_adapters.http_transport import new_client
from env_adapters.tool_calls import checked_tools
from env_adapters.web_text import fenced_action, parse_web_action

log = logging.getLogger(__name__)

# transport errors raised before the request reached the server: always safe to resend
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# HTTP statuses worth retrying (proxy / overload); 504 only for idempotent calls
_RETRY_STATUS = {502, 503}


class _Unreachable(InfraError):
    """The server could not be reached or broke off (transport level): a pool marks it down."""


class _ServerError(InfraError):
    """HTTP 200 with an ``{"error": ...}`` payload; keeps the payload for callers."""

    def __init__(self, message: str, payload: dict[str, Any]):
        super().__init__(message)
        self.payload = payload


def _clip01(x: Any) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return 0.0
    if math.isnan(v):
        return 0.0
    return min(1.0, max(0.0, v))


def _as_observation(data: Any) -> str:
    if isinstance(data, str):
        return data
    if isinstance(data, dict) and "observation" in data:
        obs = data["observation"]
        return obs if isinstance(obs, str) else str(obs)
    return "" if data is None else str(data)


# --------------------------------------------------------------------------------------------
# dialects


class Dialect:
    """The generic AgentGym protocol (this project's server)."""

    name = "agentgym"
    id_key = "id"  # the key naming the remote instance in bodies and query strings
    sends_raw_reply = True
    #: headers of every request: this dialect asks a server of this project
    #: (``env_adapters.http_server``), whose default may be an environment's AgentGym dialect,
    #: for the ``agentgym`` one; AgentGym's own servers ignore the header
    headers: dict[str, str] = {DIALECT_HEADER: "agentgym"}

    def create_body(self, task_id: int) -> dict[str, Any] | None:
        return {}

    def parse_create(self, data: Any) -> int:
        if isinstance(data, bool):
            raise ValueError(f"unexpected /create response {data!r}")
        if isinstance(data, int):
            return data
        if isinstance(data, dict):
            for key in (self.id_key, "id", "env_idx", "env_id"):
                if key in data and isinstance(data[key], int) and not isinstance(data[key], bool):
                    return data[key]
        raise ValueError(f"unexpected /create response {data!r}")

    def reset_body(self, env_id: int, task_id: int, seed: int) -> dict[str, Any]:
        return {self.id_key: env_id, "data_idx": task_id, "seed": seed}

    def parse_reset(self, data: Any) -> tuple[str, dict[str, Any]]:
        info = {}
        if isinstance(data, dict):
            info = dict(data.get("info") or {})
        return _as_observation(data), info

    def extract_action(self, reply: str) -> tuple[str | None, str | None]:
        """``(action_to_send, None)`` or ``(None, format_error_message)``."""
        return reply, None

    def step_body(self, env_id: int, action: str) -> dict[str, Any]:
        return {self.id_key: env_id, "action": action}

    def parse_step(self, data: Any) -> StepResult:
        if not isinstance(data, dict) or "observation" not in data:
            raise ValueError(f"unexpected /step response {str(data)[:200]!r}")
        info = dict(data.get("info") or {}) if isinstance(data.get("info"), dict) else {}
        if "terminated" in data or "truncated" in data:
            terminated = bool(data.get("terminated", False))
            truncated = bool(data.get("truncated", False))
        else:
            terminated, truncated = bool(data.get("done", False)), False
        raw_reward = data.get("reward", 0.0)
        info.setdefault("raw_reward", raw_reward)
        info.setdefault("format_error", False)
        return StepResult(_as_observation(data), self.reward(data), terminated, truncated, info)

    def reward(self, data: dict[str, Any]) -> float:
        return _clip01(data.get("reward", 0.0))

    def observation_params(self, env_id: int) -> dict[str, Any]:
        return {self.id_key: env_id}

    def close_body(self, env_id: int) -> dict[str, Any]:
        return {self.id_key: env_id}


def _after_action_marker(reply: str) -> str:
    """AgentGym's BabyAI/SciWorld client: drop ``</s>``, keep the text after ``Action:``."""
    if reply.endswith("</s>"):
        reply = reply[:-4]
    parts = reply.split("Action:")
    return (parts[1] if len(parts) > 1 else parts[0]).strip()


class TextCraftDialect(Dialect):
    name = "textcraft"
    headers: dict[str, str] = {}

    def create_body(self, task_id: int) -> dict[str, Any] | None:
        return {"commands": None, "goal": None}

    def reset_body(self, env_id: int, task_id: int, seed: int) -> dict[str, Any]:
        return {"id": env_id, "data_idx": task_id}

    def extract_action(self, reply: str) -> tuple[str | None, str | None]:
        matches = re.findall(r"Action:\s*(.*?)(?=\n|$)", reply, re.DOTALL)
        if len(matches) > 1:
            return None, ("Error: Only one 'Action' is allowed per response. "
                          "Please adjust your response.")
        action = matches[-1] if matches else reply.strip()
        action = re.sub(r"[^A-Za-z0-9, ]+", "", action)
        action = " ".join(action.split()).strip()
        if action.lower() == "look":  # TextCraft lists items with "inventory"
            action = "inventory"
        return action, None


class BabyAIDialect(Dialect):
    name = "babyai"
    headers: dict[str, str] = {}

    def create_body(self, task_id: int) -> dict[str, Any] | None:
        return None

    def reset_body(self, env_id: int, task_id: int, seed: int) -> dict[str, Any]:
        return {"id": env_id, "data_idx": task_id}

    def parse_reset(self, data: Any) -> tuple[str, dict[str, Any]]:
        info = {}
        if isinstance(data, dict):
            info = {k: data[k] for k in ("score", "done") if k in data}
        return _as_observation(data), info

    def extract_action(self, reply: str) -> tuple[str | None, str | None]:
        return _after_action_marker(reply), None

    def parse_step(self, data: Any) -> StepResult:
        res = super().parse_step(data)
        if "score" in data:
            res.info["score"] = data["score"]
        return res


class SciWorldDialect(BabyAIDialect):
    name = "sciworld"

    def parse_reset(self, data: Any) -> tuple[str, dict[str, Any]]:
        obs = _as_observation(data)
        info: dict[str, Any] = {}
        if isinstance(data, dict):
            if data.get("task_description"):
                obs = f"{data['task_description']}\n{obs}"
            info = {k: data[k] for k in ("task_name", "var_num", "score") if k in data}
        return obs, info

    def reward(self, data: dict[str, Any]) -> float:
        return _clip01(float(data.get("score", 0.0) or 0.0) / 100.0)

    def parse_step(self, data: Any) -> StepResult:
        res = super().parse_step(data)
        res.info["reward_is_cumulative"] = True
        return res


class DeepSearchDialect(Dialect):
    name = "deepsearch"
    headers: dict[str, str] = {}
    id_key = "env_idx"

    def create_body(self, task_id: int) -> dict[str, Any] | None:
        return {"id": task_id}

    def reset_body(self, env_id: int, task_id: int, seed: int) -> dict[str, Any]:
        return {"env_idx": env_id, "id": task_id}


class WebArenaDialect(Dialect):
    name = "webarena"
    headers: dict[str, str] = {}
    id_key = "env_idx"

    def create_body(self, task_id: int) -> dict[str, Any] | None:
        return None

    def reset_body(self, env_id: int, task_id: int, seed: int) -> dict[str, Any]:
        return {"env_idx": env_id, "seed": seed, "idx": task_id}

    def extract_action(self, reply: str) -> tuple[str | None, str | None]:
        """AgentGym's client refuses a reply without a ``` block; the server reads the first
        block with WebArena's id-based grammar and answers one it cannot parse with the error
        text. Both are refused here, as format errors, with that grammar
        (:func:`env_adapters.web_text.parse_web_action`, the MiniWoB++ adapter's); otherwise
        the raw reply is sent."""
        block = fenced_action(reply)
        if block is None:
            return None, ("Cannot parse an action from the reply: write the action inside triple "
                          "backticks, e.g. ```click [12]```.")
        action, why = parse_web_action(block)
        if action is None:
            return None, f"Invalid action in the ``` block: {why}."
        return reply, None


DIALECTS: dict[str, type[Dialect]] = {
    d.name: d for d in (Dialect, TextCraftDialect, BabyAIDialect, SciWorldDialect,
                        DeepSearchDialect, WebArenaDialect)
}


# --------------------------------------------------------------------------------------------


class HTTPEnv(TextEnv):
    """A remote AgentGym environment as a :class:`TextEnv`.

    ``base_url``: e.g. ``http://127.0.0.1:8001`` (a path prefix is kept). ``env_name``: the
    name reported in the trajectory store. ``dialect``: one of :data:`DIALECTS` (default
    ``"agentgym"``). ``timeout_s``: per request. ``retries``: extra attempts after the first.
    ``system_prompt``: returned by :meth:`system_prompt` for dialects whose servers do not
    serve one (the ``agentgym`` dialect asks the server). ``base_urls``: several servers of the
    same environment instead of ``base_url`` (see the module docstring); ``base_url`` is then
    the chosen server, ``None`` until :meth:`reset`. ``health_interval_s``: how often a pooled
    server is health-checked (a dead one comes back into rotation at its next passing check).
    """

    def __init__(self, base_url: str | None = None, env_name: str | None = None,
                 dialect: str | None = None, timeout_s: float = 30, retries: int = 3,
                 backoff_s: float = 0.5, *, system_prompt: str | None = None,
                 base_urls: list[str] | None = None, health_interval_s: float = 5.0):
        if (base_url is None) == (not base_urls):
            raise ValueError("give the server as base_url (one) or base_urls (a pool), exactly one")
        if not env_name:
            raise ValueError("env_name is required: the environment's name in the trajectory store")
        dialect = dialect or "agentgym"
        if dialect not in DIALECTS:
            raise ValueError(f"unknown dialect {dialect!r}; choose one of {sorted(DIALECTS)}")
        if timeout_s <= 0 or retries < 0 or backoff_s < 0 or health_interval_s <= 0:
            raise ValueError("timeout_s and health_interval_s must be > 0, retries and backoff_s >= 0")
        self._pool: ServerPool | None = pool_for(list(base_urls), health_interval_s) if base_urls else None
        self.base_url: str | None = base_url.rstrip("/") if base_url is not None else None
        self.name = env_name
        self.dialect = DIALECTS[dialect]()
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        self._system_prompt = system_prompt
        # one client per env (its connection), sharing the process's SSL context (http_transport)
        self._client: httpx.Client | None = new_client(self.timeout_s)
        self.env_id: int | None = None
        self._closed = False
        self._tools: list[dict[str, Any]] | None = None  # the last reset's (agentgym dialect)

    # ---------------------------------------------------------------- transport

    def _request(self, method: str, path: str, *, json: Any = None, params: Any = None,
                 idempotent: bool = True, retries: int | None = None,
                 allow_404: bool = False, text_ok: bool = False) -> Any:
        if self._client is None:
            raise InfraError(f"{self.name}: HTTPEnv for {self.base_url} is closed")
        if self.base_url is None:
            raise InfraError(f"{self.name}: no server chosen from the pool yet; call reset() first")
        url = f"{self.base_url}/{path.lstrip('/')}"
        attempts = 1 + (self.retries if retries is None else retries)
        last: str = ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                kw: dict[str, Any] = {"params": params, "headers": self.dialect.headers}
                if json is not None:
                    kw["json"] = json
                resp = self._client.request(method, url, **kw)
            except _NOT_SENT as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            except httpx.TransportError as exc:  # read/write timeout, broken connection
                last = f"{type(exc).__name__}: {exc}"
                if idempotent:
                    continue
                raise self._unreachable(
                    f"{self.name}: {method} {url} failed ({last}); not retried because the "
                    f"server may already have applied it") from exc
            status = resp.status_code
            if status in _RETRY_STATUS or (status == 504 and idempotent):
                last = f"HTTP {status}: {resp.text[:300]}"  # e.g. the server's "busy" payload
                continue
            if status == 404 and allow_404:
                return None
            if status != 200:
                raise InfraError(f"{self.name}: {method} {url} returned HTTP {status}: "
                                 f"{resp.text[:300]}")
            try:
                data = resp.json()
            except ValueError:
                if text_ok:
                    return resp.text
                raise InfraError(f"{self.name}: {method} {url} returned a non-JSON body: "
                                 f"{resp.text[:300]!r}") from None
            if isinstance(data, dict) and data.get("error") is not None:
                raise _ServerError(f"{self.name}: server at {url} reported an error: "
                                   f"{data['error']}", data)
            return data
        if last.startswith("HTTP "):  # a proxy's 502/503: the server answered, if badly
            raise InfraError(f"{self.name}: {method} {url} failed after {attempts} attempt(s): {last}")
        raise self._unreachable(f"{self.name}: {method} {url} failed after {attempts} attempt(s): {last}")

    def _unreachable(self, message: str) -> _Unreachable:
        """The transport failure to raise; a pool stops sending new episodes to this server."""
        if self._pool is not None and self.base_url is not None:
            self._pool.mark_down(self.base_url, message)
        return _Unreachable(message)

    # ---------------------------------------------------------------- TextEnv

    def _create(self, task_id: int, retries: int | None = None) -> int:
        data = self._request("POST", "create", json=self.dialect.create_body(task_id),
                             idempotent=False, retries=retries)
        try:
            self.env_id = self.dialect.parse_create(data)
        except ValueError as exc:
            raise InfraError(f"{self.name}: {self.base_url}/create: {exc}") from None
        return self.env_id

    def reset(self, task_id: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
        if self._closed:
            raise InfraError(f"{self.name}: HTTPEnv for {self.base_url} is closed")
        task_id, seed = int(task_id), int(seed)
        if self._pool is not None:
            return self._reset_pooled(task_id, seed)
        return self._reset(task_id, seed)

    def _reset(self, task_id: int, seed: int) -> tuple[str, dict[str, Any]]:
        self._tools = None  # until this reset's answer says
        env_id = self.env_id
        fresh = env_id is None
        if env_id is None:
            env_id = self._create(task_id)
        try:
            data = self._request("POST", "reset",
                                 json=self.dialect.reset_body(env_id, task_id, seed))
        except _ServerError as exc:
            # the server forgot our instance (idle reaping, restart): start over once
            if fresh or exc.payload.get("code") != "unknown_id":
                raise
            env_id = self._create(task_id)
            data = self._request("POST", "reset",
                                 json=self.dialect.reset_body(env_id, task_id, seed))
        obs, info = self.dialect.parse_reset(data)
        prompt = data.get("system_prompt") if isinstance(data, dict) else None
        if self._system_prompt is None and self.dialect.name == "agentgym" and isinstance(prompt, str):
            self._system_prompt = prompt  # what GET /system_prompt?id= would answer, one request less
        try:  # the episode's tools: a server of this project sends them with the reset
            self._tools = checked_tools(data.get("tools")) \
                if isinstance(data, dict) and self.dialect.name == "agentgym" else None
        except ValueError as exc:
            raise InfraError(f"{self.name}: {self.base_url}/reset sent malformed tools: {exc}") from None
        info.setdefault("task_id", task_id)
        info.setdefault("seed", seed)
        info["env_id"] = self.env_id
        return obs, info

    def _reset_pooled(self, task_id: int, seed: int) -> tuple[str, dict[str, Any]]:
        """Reset on the pool's choice of server. Where the server cannot create or reset the
        instance (down, at capacity), the next live one is tried: the episode starts here, so
        no state is lost by moving. Servers but the last live one get one attempt each (the
        pool's health check, not retries, brings a server back)."""
        assert self._pool is not None
        tried: list[str] = []
        while True:
            if self.env_id is None:
                try:
                    self.base_url = self._pool.acquire(exclude=tried)
                except InfraError as exc:
                    raise InfraError(f"{self.name}: {exc}") from None
            server = self.base_url
            if server is None:  # an instance is only ever held on a server the pool gave
                raise InfraError(f"{self.name}: a pooled HTTPEnv holds instance {self.env_id} but no server")
            others = self._pool.live_count(exclude=[*tried, server])
            try:
                if self.env_id is None:
                    self._create(task_id, retries=0 if others else None)
                obs, info = self._reset(task_id, seed)
                info["server"] = self.base_url
                return obs, info
            except (_Unreachable, _ServerError) as exc:
                full = isinstance(exc, _ServerError) and exc.payload.get("code") == "capacity"
                if not others or not (full or isinstance(exc, _Unreachable)):
                    raise  # a bad task id fails on every server alike; no live server is left
                tried.append(server)
                self._drop_instance()

    def _drop_instance(self) -> None:
        """Forget this episode's instance and its server (a pooled env moving elsewhere)."""
        if self.env_id is not None:
            try:  # best effort: the server may be gone
                self._request("POST", "close", json=self.dialect.close_body(self.env_id),
                              retries=0, allow_404=True, text_ok=True)
            except InfraError:
                pass
        self.env_id = None
        if self._pool is not None and self.base_url is not None:
            self._pool.release(self.base_url)
            self.base_url = None

    def step(self, action_text: str) -> StepResult:
        if self.env_id is None or self._closed:
            raise InfraError(f"{self.name}: step() on {self.base_url} before reset() or after "
                             "close()")
        # lone surrogates (invalid UTF-8 from a tokenizer) cannot go into a UTF-8 JSON body
        reply = utf8_safe(action_text if isinstance(action_text, str) else str(action_text))
        action, error = self.dialect.extract_action(reply)
        if error is not None:
            return format_error(error, parsed_action=None)
        assert action is not None  # extract_action gives an action or an error
        data = self._request("POST", "step", json=self.dialect.step_body(self.env_id, action),
                             idempotent=False)
        try:
            res = self.dialect.parse_step(data)
        except ValueError as exc:
            raise InfraError(f"{self.name}: {self.base_url}/step: {exc}") from None
        if not self.dialect.sends_raw_reply or action != reply:
            res.info.setdefault("parsed_action", action)
        return res

    def observe(self) -> str:
        """The current observation as the server reports it (``GET /observation``)."""
        if self.env_id is None:
            raise InfraError(f"{self.name}: observe() before reset()")
        return _as_observation(self._request(
            "GET", "observation", params=self.dialect.observation_params(self.env_id)))

    def system_prompt(self) -> str:
        if self._system_prompt is not None:
            return self._system_prompt
        if self.dialect.name != "agentgym":
            return ""
        params = {"id": self.env_id} if self.env_id is not None else None
        data = self._request("GET", "system_prompt", params=params, allow_404=True)
        self._system_prompt = data if isinstance(data, str) else ""
        return self._system_prompt

    def valid_actions(self) -> list[str] | None:
        if self.dialect.name != "agentgym" or self.env_id is None:
            return None
        data = self._request("GET", "valid_actions", params={"id": self.env_id}, allow_404=True)
        return [str(a) for a in data] if isinstance(data, list) else None

    def tools(self) -> list[dict[str, Any]] | None:
        """The episode's tools (OpenAI's function format) as the server sent them with the last
        reset (the ``agentgym`` dialect's ``"tools"``); ``None`` for an environment of text
        commands, for the other dialects, and before the first reset. No request of its own."""
        return self._tools

    def close(self) -> None:
        """Release the remote instance (best effort, one attempt, never raises); idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.env_id is not None and self._client is not None:
                self._request("POST", "close", json=self.dialect.close_body(self.env_id),
                              retries=0, allow_404=True, text_ok=True)
        except InfraError as exc:
            log.debug("close of %s env %s at %s failed: %s", self.name, self.env_id,
                      self.base_url, exc)
        finally:
            self.env_id = None
            if self._pool is not None and self.base_url is not None:
                self._pool.release(self.base_url)
            if self._client is not None:
                self._client.close()
                self._client = None

    def health(self) -> dict[str, Any]:
        """``GET /health`` (this project's server); raises ``InfraError`` when unreachable."""
        data = self._request("GET", "health")
        return data if isinstance(data, dict) else {"status": str(data)}

    def __repr__(self) -> str:
        return (f"HTTPEnv({self.base_url!r}, {self.name!r}, dialect={self.dialect.name!r}, "
                f"env_id={self.env_id})")


__all__ = ["DIALECTS", "Dialect", "HTTPEnv"]
