"""OpenAI chat requests as the gateway reads them: validated, normalized, compared and rendered.

* :func:`parse_request` checks a ``POST .../chat/completions`` body and returns a
  :class:`ChatRequest` (a :class:`RequestError`, answered 400, names the field that is wrong);
* :class:`Msg` is one message in a form that compares as the conversation means it (text
  parts joined, tool-call arguments compared as JSON objects, ``content: null`` as ``""``), so
  an agent that sends back the assistant message it got (the ``openai`` client's
  ``ChatCompletionMessage``, or a dict it built) extends the recorded conversation;
* :func:`render_messages` renders a whole message list fresh (a new context segment: the
  agent's history does not extend what was recorded), the way ``ChatFormatter`` renders the
  turns it builds: tools natively where the template can, else in the system text, and tool
  results as ``<tool_response>`` user turns;
* :func:`reply_message` turns a reply's text into the assistant message of the response
  (``<tool_call>`` blocks as OpenAI ``tool_calls``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from agentgym.chat import ChatFormatter, tools_system_text
from env_adapters.tool_calls import (ToolCall, ToolCallFormatError, checked_tools, parse_tool_calls,
                                     render_results_text)

ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(ValueError):
    """A request the gateway refuses: HTTP ``status``, OpenAI's error ``code`` and ``param``."""

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_request",
                 param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.code, self.param, self.kind = status, code, param, kind

    def body(self) -> dict[str, Any]:
        """The OpenAI error payload (the ``openai`` client raises it as ``BadRequestError`` etc.)."""
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def _canonical_args(args: Any) -> str:
    """Tool-call arguments (a JSON string or an object) as canonical JSON, so that equal
    arguments compare equal however they were serialized; text that is not JSON stays as is."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args
    return json.dumps(args, sort_keys=True, ensure_ascii=False)


def _args_object(args: Any) -> Any:
    """Arguments as the object chat templates render (a dict where the JSON string parses as one)."""
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args
    return args


@dataclass
class Msg:
    """One chat message, normalized. ``calls``: an assistant's tool calls in OpenAI's form
    (arguments a JSON string); ``alt_text``: for a recorded reply, the whole reply text (with
    its ``<tool_call>`` blocks), which an agent may send back instead of the content."""

    role: str
    text: str
    calls: list[dict[str, Any]] = field(default_factory=list)
    tool_call_id: str = ""
    name: str = ""
    alt_text: str | None = None

    def matches(self, given: "Msg") -> bool:
        """Whether ``given`` (a request's message) is this recorded message."""
        if self.role != given.role:
            return False
        if self.role == "tool":
            return self.tool_call_id == given.tool_call_id and self.text == given.text
        if self.role != "assistant":
            return self.text == given.text
        if given.text != self.text and given.text != self.alt_text:
            return False
        if len(self.calls) != len(given.calls):
            return False
        for mine, theirs in zip(self.calls, given.calls):
            if theirs.get("id") and theirs["id"] != mine.get("id"):
                return False
            if mine["function"]["name"] != theirs["function"]["name"] or \
                    _canonical_args(mine["function"]["arguments"]) != _canonical_args(theirs["function"]["arguments"]):
                return False
        return True


@dataclass
class ChatRequest:
    """A validated chat-completions request (the fields the gateway uses; others are ignored)."""

    messages: list[Msg]
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    logprobs: bool = False


def _text(content: Any, where: str, *, allow_none: bool = False) -> str:
    if content is None and allow_none:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}.content[{k}] must be a text part {{\"type\": \"text\", \"text\": str}} "
                                   "(the gateway serves a text model)", param=f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where}.content must be a string or a list of text parts, got "
                       f"{type(content).__name__}", param=f"{where}.content")


def _calls(raw: Any, where: str) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise RequestError(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for k, c in enumerate(raw):
        fn = c.get("function") if isinstance(c, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"] \
                or not isinstance(fn.get("arguments", "{}"), (str, dict)):
            raise RequestError(f'{where}.tool_calls[{k}] must be {{"id", "type": "function", "function": '
                               '{"name": str, "arguments": str}}', param=f"{where}.tool_calls")
        cid = c.get("id")
        if cid is not None and not isinstance(cid, str):
            raise RequestError(f"{where}.tool_calls[{k}].id must be a string", param=f"{where}.tool_calls")
        args = fn.get("arguments", "{}")
        out.append({"id": cid or "", "type": "function",
                    "function": {"name": fn["name"],
                                 "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}})
    return out


def parse_messages(raw: Any) -> list[Msg]:
    """The request's ``messages``, normalized; :class:`RequestError` for a malformed list. A
    system (or developer) message may only come first, and the last message must be the user's
    or a tool result (the gateway answers with the next assistant message)."""
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages must be a non-empty list of chat messages", param="messages")
    out: list[Msg] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise RequestError(f"{where} must be an object with a role and content", param=where)
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role")
        if role in ("system", "developer"):
            if i:
                raise RequestError(f"{where}: a {role} message may only be the first message", param=where)
            out.append(Msg("system", _text(m.get("content"), where)))
        elif role == "user":
            out.append(Msg("user", _text(m.get("content"), where)))
        elif role == "assistant":
            calls = _calls(m.get("tool_calls"), where)
            out.append(Msg("assistant", _text(m.get("content"), where, allow_none=True), calls))
        else:
            cid = m.get("tool_call_id")
            if not isinstance(cid, str):
                raise RequestError(f"{where}: a tool message needs its tool_call_id (a string)",
                                   param=f"{where}.tool_call_id")
            name = m.get("name")
            out.append(Msg("tool", _text(m.get("content"), where), tool_call_id=cid,
                           name=name if isinstance(name, str) else ""))
    if out[-1].role not in ("user", "tool"):
        raise RequestError(f"the last message must be a user message or a tool result, got "
                           f"{out[-1].role!r}: the gateway answers with the next assistant message",
                           param=f"messages[{len(out) - 1}]")
    return out


def _positive_int(body: Mapping[str, Any], key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise RequestError(f"{key} must be a positive integer, got {v!r}", param=key)
    return v


def _number(body: Mapping[str, Any], key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise RequestError(f"{key} must be a number in [{lo}, {hi}], got {v!r}", param=key)
    return float(v)


def parse_request(body: Any) -> ChatRequest:
    """A chat-completions body, validated; :class:`RequestError` (400) names what is wrong.
    Refused: ``stream: true`` (not supported), ``n`` > 1, malformed messages or tools."""
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object")
    if body.get("stream"):
        raise RequestError("stream=true is not supported by the agentgym gateway: request the whole "
                           "completion (stream=false)", param="stream", code="unsupported_parameter")
    n = body.get("n")
    if n is not None and n != 1:
        raise RequestError(f"n={n!r} is not supported: the gateway samples one reply per request",
                           param="n", code="unsupported_parameter")
    messages = parse_messages(body.get("messages"))
    try:
        tools = checked_tools(body.get("tools"))
    except ValueError as e:
        raise RequestError(f"tools: {e}", param="tools") from None
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise RequestError("stop must be a string or a list of non-empty strings", param="stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(f"seed must be an integer, got {seed!r}", param="seed")
    max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    return ChatRequest(messages, tools, max_tokens, _number(body, "temperature", 0.0, 2.0),
                       _number(body, "top_p", 0.0, 1.0), seed, stop, bool(body.get("logprobs")))


def tool_results(new: Sequence[Msg], calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Tool messages as the step results ``ChatFormatter.tool_glue`` takes (a result's name is
    the message's, else the name of the call it answers)."""
    names = {c.get("id"): c["function"]["name"] for c in calls}
    return [{"tool_call_id": m.tool_call_id, "name": m.name or names.get(m.tool_call_id, ""), "content": m.text}
            for m in new]


def _call_block(call: Mapping[str, Any]) -> str:
    args = _args_object(call["function"]["arguments"])
    return "<tool_call>\n" + json.dumps({"name": call["function"]["name"], "arguments": args},
                                        ensure_ascii=False) + "\n</tool_call>"


def render_messages(formatter: ChatFormatter, messages: Sequence[Msg],
                    tools: Sequence[Mapping[str, Any]] | None) -> list[int]:
    """Prompt ids for the whole conversation ``messages`` (the last one the user's or a tool
    result), ending where the next reply begins.

    ``[system?, user]`` is exactly ``formatter.start`` (the rollout's first prompt). Longer lists
    are rendered by the template at once: natively (assistant ``tool_calls`` and ``tool``
    messages) where ``formatter.native_tools``, else the tools in the system text
    (``tools_system_text``), an assistant's calls as ``<tool_call>`` blocks after its content and
    each run of tool messages as one ``<tool_response>`` user turn, as the rollout's fallback
    glue writes them."""
    system = messages[0].text if messages[0].role == "system" else None
    rest = list(messages[1:] if system is not None else messages)
    if len(rest) == 1 and rest[0].role == "user":
        return formatter.start(system, rest[0].text, tools=tools)
    native = formatter.native_tools
    out: list[dict[str, Any]] = []
    sys_text = tools_system_text(system, tools) if tools and not formatter.native_tools else system
    if sys_text:
        out.append({"role": "system", "content": sys_text})
    pending: list[dict[str, Any]] = []  # a run of tool results (the fallback's one user turn)
    for m in rest:
        if m.role == "tool" and not native:
            pending.append({"content": m.text})
            continue
        if pending:
            out.append({"role": "user", "content": render_results_text(pending)})
            pending = []
        if m.role == "assistant":
            if m.calls and native:
                out.append({"role": "assistant", "content": m.text, "tool_calls": [
                    {"id": c["id"] or f"call_{k}", "type": "function",
                     "function": {"name": c["function"]["name"], "arguments": _args_object(c["function"]["arguments"])}}
                    for k, c in enumerate(m.calls)]})
            else:
                text = "\n".join([m.text] * bool(m.text) + [_call_block(c) for c in m.calls])
                out.append({"role": "assistant", "content": text})
        elif m.role == "tool":
            out.append({"role": "tool", "tool_call_id": m.tool_call_id, "name": m.name, "content": m.text})
        else:
            out.append({"role": m.role, "content": m.text})
    if pending:
        out.append({"role": "user", "content": render_results_text(pending)})
    kw: dict[str, Any] = {"tools": list(tools)} if tools and formatter.native_tools else {}
    tok = formatter.tokenizer
    text = cast(str, tok.apply_chat_template(cast(Any, out), tokenize=False, add_generation_prompt=True, **kw))
    return list(tok(text + formatter.response_prefix, add_special_tokens=False)["input_ids"])


@dataclass
class Reply:
    """A sampled reply as the response carries it and as the episode records it."""

    text: str  # the whole reply (ChatFormatter.reply_text)
    content: str | None  # the message content: the text outside the tool-call blocks
    calls: list[ToolCall]
    format_error: str | None  # why the reply's <tool_call> blocks could not be read

    def message(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            out["tool_calls"] = [c.as_openai() for c in self.calls]
        return out

    def recorded(self) -> Msg:
        return Msg("assistant", self.content or "", [c.as_openai() for c in self.calls], alt_text=self.text)

    def parsed_action(self) -> str | None:
        return "; ".join(f"{c.name}({json.dumps(c.arguments, ensure_ascii=False)})" for c in self.calls) or None


def reply_message(text: str, turn: int) -> Reply:
    """The reply ``text`` of the episode's reply number ``turn``: its ``<tool_call>`` blocks as
    calls (ids ``call_<turn>_<k>``, as a ``ToolEnv`` numbers them) and the text around them as
    the content (None where empty); a reply whose blocks cannot be read is content alone,
    with the reason kept as a format error."""
    try:
        calls, outside = parse_tool_calls(text, turn)
    except ToolCallFormatError as e:
        return Reply(text, text, [], str(e))
    if not calls:
        return Reply(text, text, [], None)
    return Reply(text, outside or None, calls, None)
