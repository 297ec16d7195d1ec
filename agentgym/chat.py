"""Multi-turn conversations as token ids, built incrementally from *any* HF chat template.

The rollout never decodes a reply and re-encodes it (that drifts: BPE merges across the
reply/template boundary differ). Instead the conversation is a growing list of ids:

    start(system, obs0)  -> prompt ids (mask 0), ending in the assistant generation prompt
    <sampled reply ids>  -> appended as-is (mask 1)
    glue(obs, ended)     -> ids that close the assistant turn, add the next user turn and open
                            the next assistant turn (mask 0)

The glue is derived from the tokenizer's own template by rendering a probe conversation with
and without the extra turn and taking the difference, so ChatML, Llama-3 style, SmolLM2's or
any other template works without hard-coding (AgentGym-RL hard-codes Qwen's).

Tools (function calls as actions, ``env_adapters.tool_calls``): ``start(system, obs0, tools=...)``
puts the environment's tool schemas into the prompt, and after a step whose info carries
``tool_results`` the rollout glues with ``tool_glue(results, ended, calls)`` instead of ``glue``.
The template is probed once (:attr:`ChatFormatter.native_tools`):

* **native** (Qwen2.5, Llama-3.1 style: the template renders ``tools=`` and an assistant message
  with ``tool_calls`` followed by ``role: tool`` messages): the tools go through
  ``apply_chat_template(..., tools=...)``, and the tool glue is derived like ``glue``: a probe
  user turn and an assistant turn carrying the step's calls, rendered closed, then with the
  step's ``tool`` messages and the generation prompt; the difference is what follows the
  assistant suffix. The sampled reply itself is never re-rendered: only the glue comes from the
  template.
* **fallback** (SmolLM2's and the tiny test templates render neither): the schemas go into the
  system text (:func:`tools_system_text`: the tools as JSON inside ``<tools></tools>`` and the
  ``<tool_call>`` instruction), and a step's results come back as one user turn whose content is
  ``render_results_text(results)`` (``<tool_response>`` blocks), glued by ``glue``.

``tools=None`` (an environment of text commands) renders exactly as before tools existed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from env_adapters.tool_calls import TOOL_CALLS, TOOL_RESULTS, render_results_text, tool_schema

_PROBE_USER = "\u2063probe-user\u2063"
_PROBE_REPLY = "\u2063probe-reply\u2063"
# a user turn and its reply: rendered closed, it shows what the template puts around turns
_PROBE = ({"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_REPLY})
# the tool probe: plain ASCII markers (templates may pass tool text through tojson)
_PROBE_TOOL = "probe_tool_7f3c"
_PROBE_ARG = "probe-arg-2d9e"
_PROBE_RESULT = "probe-result-81b4"
_PROBE_TOOLS = [tool_schema(_PROBE_TOOL, "A probe of the chat template.",
                            {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]})]

#: The fallback's tool section (Hermes / Qwen style), after the system prompt: ``{tools}`` is one
#: JSON schema per line.
TOOLS_SECTION = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def tools_system_text(system: str | None, tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text of the fallback: ``system`` (if any), a blank line, then the tool section
    (:data:`TOOLS_SECTION`: each schema as one line of JSON inside ``<tools></tools>``, and how to
    write a ``<tool_call>`` block)."""
    section = TOOLS_SECTION.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    return f"{system}\n\n{section}" if system else section


def _message_call(call: Mapping[str, Any], fallback_id: str) -> dict[str, Any]:
    """An OpenAI ``tool_calls`` item (arguments a JSON string or a dict) as the assistant
    message item templates render (arguments a dict where they parse as one)."""
    inner = call.get("function")
    fn: Mapping[str, Any] = inner if isinstance(inner, Mapping) else call
    args: Any = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass
    return {"id": str(call.get("id") or fallback_id), "type": "function",
            "function": {"name": str(fn.get("name", "")), "arguments": args}}


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be extended turn by turn."""


@dataclass
class ChatFormatter:
    tokenizer: PreTrainedTokenizerBase
    response_prefix: str = ""

    def __post_init__(self) -> None:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ChatTemplateError(
                "the tokenizer has no chat_template; set tokenizer.chat_template or use an "
                "instruct model folder that ships one"
            )

    # -- template probing -------------------------------------------------------------
    def _render(self, messages: Sequence[Mapping[str, Any]], generation_prompt: bool,
                tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        # tokenize=False: the rendered text (transformers types every return mode together);
        # no tools: the call made before tools existed, keyword for keyword
        kw: dict[str, Any] = {"tools": list(tools)} if tools else {}
        return cast(str, self.tokenizer.apply_chat_template(
            cast(Any, list(messages)), tokenize=False, add_generation_prompt=generation_prompt, **kw
        ))

    def _encode(self, text: str) -> list[int]:
        # apply_chat_template itself tokenizes with add_special_tokens=False: do the same.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @staticmethod
    def _base(system: str | None) -> list[dict[str, str]]:
        return [{"role": "system", "content": system}] if system else []

    @cached_property
    def native_tools(self) -> bool:
        """Whether the template renders tools itself (probed once): ``tools=`` shows the tool
        schemas, and an assistant message with ``tool_calls`` followed by a ``role: tool``
        message shows the call's arguments and the result after the user's turn. Any error a
        template raises on the probe (SmolLM2's raises ``TypeError`` on ``content=None``, others
        ``raise_exception``) means no: the fallback is used."""
        user = {"role": "user", "content": _PROBE_USER}
        call = {"id": "call_0_0", "type": "function",
                "function": {"name": _PROBE_TOOL, "arguments": {"x": _PROBE_ARG}}}
        conv: list[dict[str, Any]] = [user, {"role": "assistant", "content": _PROBE_REPLY, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0_0", "name": _PROBE_TOOL, "content": _PROBE_RESULT}]
        try:
            head = self._render([user], True, _PROBE_TOOLS)
            text = self._render(conv, True, _PROBE_TOOLS)
        except Exception:  # noqa: BLE001 - any template error: no native tools
            return False
        if _PROBE_TOOL not in head or _PROBE_USER not in text:
            return False
        tail = text[text.index(_PROBE_USER) + len(_PROBE_USER):]
        return _PROBE_ARG in tail and _PROBE_RESULT in tail

    @cached_property
    def assistant_suffix(self) -> str:
        """Text the template puts after an assistant message's content (e.g. '<|im_end|>\\n')."""
        text = self._closed_probe
        if _PROBE_REPLY not in text:
            raise ChatTemplateError("chat template drops assistant content; cannot build turns")
        return text[text.index(_PROBE_REPLY) + len(_PROBE_REPLY):]

    @cached_property
    def end_of_turn_ids(self) -> list[int]:
        """Token ids whose sampling ends a reply: the template's closing special token and EOS."""
        ids: list[int] = []
        special = set(self.tokenizer.all_special_tokens) | set(
            getattr(self.tokenizer, "added_tokens_encoder", {}) or {}
        )
        for tok in sorted(special, key=len, reverse=True):
            if tok and self.assistant_suffix.startswith(tok):
                ids.append(cast(int, self.tokenizer.convert_tokens_to_ids(tok)))  # one token: one id
                break
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(self.tokenizer.eos_token_id)
        return ids

    # -- building conversations ---------------------------------------------------------
    def start(self, system: str | None, observation: str,
              tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Prompt ids for the first turn, ending where the model's reply begins.

        ``tools``: the environment's tool schemas (``TextEnv.tools()``, OpenAI's function
        format), rendered by the template where it can (:attr:`native_tools`), else as a tool
        section of the system text (:func:`tools_system_text`). None or empty: no tools (the
        same ids as before tools existed)."""
        if tools and not self.native_tools:
            system, tools = tools_system_text(system, tools), None
        text = self._render(self._base(system) + [{"role": "user", "content": observation}], True, tools)
        return self._encode(text + self.response_prefix)

    def glue(self, observation: str, reply_ended_turn: bool) -> list[int]:
        """Ids between a finished reply and the next reply.

        ``reply_ended_turn``: the sampled reply already ends with the template's end-of-turn
        token, so only the rest of the assistant suffix is added (a reply cut by a stop
        string or the token budget gets the whole suffix).
        """
        closed = self._closed_probe
        extended = self._render([*_PROBE, {"role": "user", "content": observation}], True)
        if not extended.startswith(closed):
            raise ChatTemplateError(
                "chat template re-renders earlier turns when a turn is added; incremental "
                "multi-turn tokenization is impossible with it"
            )
        return self._suffix_ids[reply_ended_turn] + self._encode(extended[len(closed):] + self.response_prefix)

    def tool_glue(self, results: Sequence[Mapping[str, Any]], reply_ended_turn: bool,
                  calls: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Ids between a reply that made tool calls and the next reply: the end of the assistant
        turn, the step's results and the next assistant prompt.

        ``results``: ``info["tool_results"]`` (``[{"tool_call_id", "name", "content"}]``, one per
        call, in order); ``calls``: ``info["tool_calls"]`` (OpenAI's form; where missing, calls
        are made up from the results' ids and names). ``reply_ended_turn`` as for :meth:`glue`.

        Native templates: the results are ``role: tool`` messages after an assistant message
        carrying the calls (the probe reply as its content), rendered by the template; the glue
        is the difference between that conversation closed and extended (with a single call if
        the template refuses several, as Llama 3.1's does). Raises :class:`ChatTemplateError`
        where the extension re-renders the closed part or the tool-calling turn does not end
        with :attr:`assistant_suffix`. Fallback: ``glue(render_results_text(results), ...)``.
        """
        if not results:
            raise ValueError("tool_glue needs at least one tool result")
        if not self.native_tools:
            return self.glue(render_results_text([dict(r) for r in results]), reply_ended_turn)
        made = [_message_call(c, f"call_{k}") for k, c in enumerate(calls or [])]
        if len(made) != len(results):  # the calls the results answer, by id and name
            made = [_message_call({"id": r.get("tool_call_id"), "name": r.get("name"), "arguments": {}},
                                  f"call_{k}") for k, r in enumerate(results)]
        answers = [{"role": "tool", "tool_call_id": str(r.get("tool_call_id", "")), "name": str(r.get("name", "")),
                    "content": r["content"] if isinstance(r.get("content"), str) else json.dumps(r.get("content"))}
                   for r in results]
        user = {"role": "user", "content": _PROBE_USER}
        error: Exception | None = None
        for tool_calls in ([made, made[:1]] if len(made) > 1 else [made]):
            assistant = {"role": "assistant", "content": _PROBE_REPLY, "tool_calls": tool_calls}
            try:
                closed = self._render([user, assistant], False, _PROBE_TOOLS)
                extended = self._render([user, assistant, *answers], True, _PROBE_TOOLS)
                break
            except Exception as e:  # noqa: BLE001 - a template that refuses this form of the calls
                error = e
        else:
            raise ChatTemplateError(f"the chat template cannot render this step's tool results: "
                                    f"{type(error).__name__}: {error}") from error
        if not extended.startswith(closed):
            raise ChatTemplateError(
                "chat template re-renders earlier turns when tool results are added; incremental "
                "multi-turn tokenization is impossible with it")
        if not closed.endswith(self.assistant_suffix):
            raise ChatTemplateError(
                f"chat template ends a tool-calling assistant turn differently from a plain one "
                f"(not with {self.assistant_suffix!r}); the sampled reply cannot be closed by the template")
        return self._suffix_ids[reply_ended_turn] + self._encode(extended[len(closed):] + self.response_prefix)

    def glue_step(self, observation: str, info: Mapping[str, Any] | None, reply_ended_turn: bool) -> list[int]:
        """The glue after an environment step: :meth:`tool_glue` when the step's ``info`` carries
        ``tool_results`` (a non-empty list), else :meth:`glue` of the observation."""
        results = (info or {}).get(TOOL_RESULTS)
        if results:
            return self.tool_glue(results, reply_ended_turn, (info or {}).get(TOOL_CALLS))
        return self.glue(observation, reply_ended_turn)

    @cached_property
    def _closed_probe(self) -> str:
        """The probe conversation (a user turn and a reply) rendered closed: the part of every
        ``glue`` rendering that comes before the new observation, and where ``assistant_suffix``
        is read (rendered once, not per turn)."""
        return self._render(list(_PROBE), False)

    @cached_property
    def _suffix_ids(self) -> dict[bool, list[int]]:
        """The ids that close an assistant turn, by ``reply_ended_turn`` (the whole assistant
        suffix, or what follows the end-of-turn token the reply already ends with): encoded
        once, not per episode per turn (the rollout glues every live episode every turn)."""
        suffix = ended = self.assistant_suffix
        eot = cast(str, self.tokenizer.convert_ids_to_tokens(self.end_of_turn_ids[0]))  # one id: one token
        if suffix.startswith(eot):
            ended = suffix[len(eot):]
        return {False: self._encode(suffix), True: self._encode(ended)}

    def action_reply_ids(self, action: str, stop: list[str]) -> list[int]:
        """The token ids of the reply that says ``action``, as the policy is trained to write it.

        * with a ``response_prefix`` (e.g. ``"Action:"``, forced by the rollout): `` <action>``
          followed by the first stop string (``"\\n"``) when the rollout stops on one -- what the
          engine returns when it stops there -- else by the end-of-turn token;
        * without one: AgentGym's ReAct lines ``Thought:\\n...\\n\\nAction:\\n<action>`` and the
          end-of-turn token; an action that holds a tool call (a ``<tool_call>`` block: a tool
          environment's expert or listed actions) is the reply as it is, and the end-of-turn token.

        Expert demonstrations are written this way, and action-constrained decoding scores
        exactly these ids for each valid action.
        """
        tok = self.tokenizer
        if self.response_prefix:
            sep = "" if self.response_prefix.endswith((" ", "\n")) else " "
            text = sep + action
            if stop:
                return list(tok(text + stop[0], add_special_tokens=False)["input_ids"])
            return list(tok(text, add_special_tokens=False)["input_ids"]) + self.end_of_turn_ids[:1]
        text = action if "<tool_call>" in action else \
            f"Thought:\nI will {action}.\n\nAction:\n{action}"
        return list(tok(text, add_special_tokens=False)["input_ids"]) + self.end_of_turn_ids[:1]

    def ends_turn(self, token_ids: list[int]) -> bool:
        return bool(token_ids) and token_ids[-1] in self.end_of_turn_ids

    def reply_text(self, token_ids: list[int]) -> str:
        """The reply as the environment sees it: forced prefix + decoded sampled tokens."""
        ids = token_ids[:-1] if self.ends_turn(token_ids) else token_ids
        # one sequence of ids decodes to one str
        return self.response_prefix + cast(str, self.tokenizer.decode(ids, skip_special_tokens=True))
