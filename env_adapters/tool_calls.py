"""Function calls as actions: the shared contract between tool-using environments, the chat
formatter and the OpenAI-compatible gateway.

An environment that offers tools returns their schemas from ``TextEnv.tools()`` (OpenAI's
function format, ``{"type": "function", "function": {"name", "description", "parameters"}}``).
The model calls them in its reply as Hermes/Qwen-style blocks, whatever the chat template::

    <tool_call>
    {"name": "cd", "arguments": {"folder": "documents"}}
    </tool_call>

:func:`parse_tool_calls` reads them. A malformed block is a :class:`ToolCallFormatError` whose
message is written for the model; a :class:`ToolEnv` turns it into a format-error observation,
never an exception. The results of a step's calls travel in ``StepResult.info["tool_results"]``
(:data:`TOOL_RESULTS`: ``[{"tool_call_id", "name", "content"}]``, one per call, in call order),
so the rollout renders them as the template's ``tool`` messages (or a ``<tool_response>`` user
turn where the template has none: ``agentgym.chat``), and the observation string holds the same
results as text, for people (the ``turns`` table, the viewer).
"""

from __future__ import annotations

import abc
import json
import re
from dataclasses import dataclass, field
from typing import Any

from env_adapters.base import StepResult, TextEnv, format_error

TOOL_RESULTS = "tool_results"  # StepResult.info key: the step's results, one per call
TOOL_CALLS = "tool_calls"      # StepResult.info key: the calls the reply made, as parsed
_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
MAX_CALLS_PER_REPLY = 8


@dataclass(frozen=True)
class ToolCall:
    """One function call of a reply: ``id`` is deterministic (``call_<turn>_<k>``), so a replayed
    episode renders the same ids."""
    name: str
    arguments: dict[str, Any]
    id: str = ""

    def as_openai(self) -> dict[str, Any]:
        """The call as an OpenAI chat ``tool_calls`` item (arguments as a JSON string)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}

    def as_message_call(self) -> dict[str, Any]:
        """The call as a chat template's assistant ``tool_calls`` item (arguments as a dict, the
        form Qwen2.5's and Llama-3.1's templates render)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallFormatError(ValueError):
    """A reply's tool call cannot be read; the message says what to fix, for the model."""


def tool_schema(name: str, description: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """A tool in OpenAI's function format (``parameters``: a JSON schema of an object)."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": parameters or {"type": "object", "properties": {}, "required": []}}}


def parse_tool_calls(reply: str, turn: int = 0) -> tuple[list[ToolCall], str]:
    """The calls in ``reply`` and the text outside them (stripped).

    Raises :class:`ToolCallFormatError` for an unclosed block, a block that is not a JSON object
    with a string ``name`` and an object ``arguments`` (a JSON string holding an object is
    accepted, as OpenAI sends it), or more than :data:`MAX_CALLS_PER_REPLY` calls. A reply
    with no block returns ``([], reply)``: whether that is an error is the environment's call.
    """
    if not isinstance(reply, str):
        raise ToolCallFormatError("the reply is not text")
    calls: list[ToolCall] = []
    for k, m in enumerate(_BLOCK.finditer(reply)):
        if not m.group(2):
            raise ToolCallFormatError("a <tool_call> block is not closed with </tool_call>")
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            raise ToolCallFormatError(f"a <tool_call> block is not valid JSON ({e.msg} at character {e.pos})") from None
        except RecursionError:  # e.g. 100,000 nested brackets: the model's text, never a crash
            raise ToolCallFormatError("a <tool_call> block nests JSON too deeply") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            raise ToolCallFormatError('a <tool_call> block must be a JSON object with a "name" string')
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (json.JSONDecodeError, RecursionError):
                raise ToolCallFormatError(f'the "arguments" of {obj["name"]} are not a JSON object') from None
        if not isinstance(args, dict):
            raise ToolCallFormatError(f'the "arguments" of {obj["name"]} must be a JSON object')
        calls.append(ToolCall(obj["name"], args, f"call_{turn}_{k}"))
        if len(calls) > MAX_CALLS_PER_REPLY:
            raise ToolCallFormatError(f"more than {MAX_CALLS_PER_REPLY} tool calls in one reply")
    return calls, _BLOCK.sub("", reply).strip()


def render_results_text(results: list[dict[str, Any]]) -> str:
    """The results as one text observation (the ``<tool_response>`` form the fallback template
    turn uses, and what people read in the ``turns`` table)."""
    return "\n".join(f"<tool_response>\n{r['content']}\n</tool_response>" for r in results)


class ToolError(Exception):
    """A tool call the environment refuses (unknown tool, bad arguments, the tool's own error):
    its message becomes the call's result, and the episode goes on."""


@dataclass
class ToolOutcome:
    """What one call did: its result text, whether it ends the episode, and its reward then."""
    content: str
    done: bool = False
    reward: float = 0.0
    success: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class ToolEnv(TextEnv):
    """A ``TextEnv`` whose actions are function calls. Subclasses give ``tools()``,
    ``_reset`` and ``call_tool``; ``step`` parses the reply, runs each call in order (stopping
    at one that ends the episode), and returns the results in ``info["tool_results"]``.

    A reply with no call, or a malformed one, is a format-error observation (the turn is
    consumed); a call the environment refuses (:class:`ToolError`) is an ordinary result the
    model reads. An infrastructure fault (``InfraError``) propagates.
    """

    turn: int = 0

    @abc.abstractmethod
    def tools(self) -> list[dict[str, Any]]:
        """The tools of the current episode, in OpenAI's function format."""

    @abc.abstractmethod
    def _reset(self, task_id: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
        """Start the episode; the first observation (the user's request) and an info dict."""

    @abc.abstractmethod
    def call_tool(self, call: ToolCall) -> ToolOutcome:
        """Run one call; raise :class:`ToolError` for a call the model should read an error for."""

    def no_call_observation(self, text: str) -> StepResult:
        """A reply without a tool call: a format error by default (an environment whose users
        also take plain answers overrides this)."""
        return format_error("Your reply made no tool call. Call one of the tools with a "
                            '<tool_call>{"name": ..., "arguments": {...}}</tool_call> block.',
                            parsed_action=None, success=False)

    def reset(self, task_id: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
        self.turn = 0
        return self._reset(task_id, seed)

    def step(self, action_text: str) -> StepResult:
        turn, self.turn = self.turn, self.turn + 1
        try:
            calls, text = parse_tool_calls(action_text, turn)
        except ToolCallFormatError as e:
            return format_error(f"Your tool call could not be read: {e}. Write each call as "
                                '<tool_call>{"name": ..., "arguments": {...}}</tool_call>.',
                                parsed_action=None, success=False)
        if not calls:
            return self.no_call_observation(text)
        results: list[dict[str, Any]] = []
        reward, done, success, info = 0.0, False, False, {}
        for call in calls:
            try:
                out = self.call_tool(call)
            except ToolError as e:
                out = ToolOutcome(f"Error: {e}")
                info["invalid_action"] = True
            results.append({"tool_call_id": call.id, "name": call.name, "content": out.content})
            info.update(out.info)
            if out.done:
                reward, done, success = out.reward, True, out.success
                break
        parsed = "; ".join(f"{c.name}({json.dumps(c.arguments, ensure_ascii=False)})"
                           for c in calls[:len(results)])
        return StepResult(render_results_text(results), reward, done, False,
                          {**info, "parsed_action": parsed, "success": success, "format_error": False,
                           TOOL_CALLS: [c.as_openai() for c in calls[:len(results)]], TOOL_RESULTS: results})


def checked_tools(tools: Any) -> list[dict[str, Any]] | None:
    """``tools`` (what ``TextEnv.tools()`` returned) if well formed, ``None`` for ``None`` or an
    empty list (no tools); else ``ValueError`` naming what is wrong.

    Well formed: a list of OpenAI function tools, each ``{"type": "function", "function":
    {"name", "description"?, "parameters"?}}`` with a non-empty string name unique in the list, a
    string description where given, parameters a JSON schema object (``"type": "object"``) where
    given, and the whole list JSON-serializable (it is rendered into prompts and sent over HTTP).
    """
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ValueError(f"tools() must return None or a list, got {type(tools).__name__}")
    if not tools:
        return None
    names: set[str] = set()
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f'tool {k} must be {{"type": "function", "function": {{...}}}}, got {tool!r:.200}')
        name = fn.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"tool {k} has no name (a non-empty string)")
        if name in names:
            raise ValueError(f"tool name {name!r} appears twice")
        names.add(name)
        if "description" in fn and not isinstance(fn["description"], str):
            raise ValueError(f"tool {name!r}: description must be a string")
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type") != "object"):
            raise ValueError(f'tool {name!r}: parameters must be a JSON schema with "type": "object"')
    try:
        json.dumps(tools, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"tools are not JSON-serializable: {e}") from None
    return tools


def checked_tool_results(info: Any) -> list[dict[str, Any]] | None:
    """``info[TOOL_RESULTS]`` if well formed, ``None`` where the step carries none (absent, None
    or empty); else ``ValueError`` naming what is wrong.

    Well formed: a list of ``{"tool_call_id": str, "name": str, "content": str}``; and where
    ``info[TOOL_CALLS]`` is given, a list of OpenAI calls (``{"id", "type": "function",
    "function": {"name", "arguments"}}``) of the same length whose ids and names are the
    results', in order.
    """
    if not isinstance(info, dict):
        return None
    results = info.get(TOOL_RESULTS)
    if results is None or results == []:
        return None
    if not isinstance(results, list):
        raise ValueError(f"info[{TOOL_RESULTS!r}] must be a list, got {type(results).__name__}")
    for k, r in enumerate(results):
        if not isinstance(r, dict) or not all(isinstance(r.get(key), str)
                                              for key in ("tool_call_id", "name", "content")):
            raise ValueError(f'tool result {k} must be {{"tool_call_id": str, "name": str, "content": str}}, '
                             f"got {r!r:.200}")
    calls = info.get(TOOL_CALLS)
    if calls is None:
        return results
    if not isinstance(calls, list) or len(calls) != len(results):
        raise ValueError(f"info[{TOOL_CALLS!r}] must be a list of one call per result ({len(results)})")
    for k, (c, r) in enumerate(zip(calls, results)):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments"), (str, dict)):
            raise ValueError(f'tool call {k} must be {{"id", "type": "function", "function": '
                             f'{{"name", "arguments"}}}}, got {c!r:.200}')
        if c.get("id") != r["tool_call_id"] or fn["name"] != r["name"]:
            raise ValueError(f"tool call {k} ({c.get('id')!r}, {fn['name']!r}) does not match its result "
                             f"({r['tool_call_id']!r}, {r['name']!r})")
    return results
