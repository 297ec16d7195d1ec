"""ChatFormatter with tools: the template probe, the fallback's system text and ``<tool_response>``
user turn, the native tool glue (derived from the template, never re-rendering the reply), and
the ids of conversations without tools unchanged since before tools existed.

The native template is Qwen2.5-Instruct's chat template (the ``chat_template`` of the
``Qwen/Qwen2.5-*-Instruct`` tokenizer_config.json, Apache-2.0), in fixtures/, set on the tiny
tokenizer (whose special tokens include ``<|im_start|>`` / ``<|im_end|>``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agentgym.chat import ChatFormatter, ChatTemplateError, tools_system_text
from env_adapters.tool_calls import TOOL_CALLS, TOOL_RESULTS, ToolCall, parse_tool_calls, render_results_text

FIXTURES = Path(__file__).parent / "fixtures"
QWEN25 = (FIXTURES / "qwen2_5_chat_template.jinja").read_text()
TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "recall", "description": "The memory.",
                                      "parameters": {"type": "object", "properties": {}}}},
]


def _tok(path, template: str | None = None):
    tok = AutoTokenizer.from_pretrained(path)
    if template is not None:
        tok.chat_template = template
    return tok


@pytest.fixture(params=["chatml", "llama3"])
def tiny_tok(request, tiny_path, tiny_llama3_path):
    return _tok(tiny_path if request.param == "chatml" else tiny_llama3_path)


@pytest.fixture
def qwen_tok(tiny_path):
    return _tok(tiny_path, QWEN25)


def _calls(reply: str, turn: int) -> tuple[list[dict], list[dict]]:
    """The OpenAI calls of ``reply`` and made-up results, as a ToolEnv step gives them."""
    calls, _ = parse_tool_calls(reply, turn)
    return ([c.as_openai() for c in calls],
            [{"tool_call_id": c.id, "name": c.name, "content": f"result {k} of {c.name}"} for k, c in enumerate(calls)])


# -- no tools: the same ids as before --------------------------------------------------------------
@pytest.mark.parametrize("template", ["chatml", "llama3"])
@pytest.mark.parametrize("prefix", ["", "Action:"])
def test_without_tools_the_ids_are_those_of_before_tools(template, prefix, tiny_path, tiny_llama3_path):
    """fixtures/chat_ids_before_tools.json was written by chat.py before tools existed
    (commit fea057f) with these calls on the tiny tokenizers."""
    want = json.loads((FIXTURES / "chat_ids_before_tools.json").read_text())[f"{template}|{prefix}"]
    fmt = ChatFormatter(_tok(tiny_path if template == "chatml" else tiny_llama3_path), response_prefix=prefix)
    for tools in (None, []):
        assert fmt.start("You are an agent.", "Go to the red ball.\nYou see a wall.", tools=tools) == want["start_sys"]
    assert fmt.start("You are an agent.", "Go to the red ball.\nYou see a wall.") == want["start_sys"]
    assert fmt.start(None, "hello") == want["start_nosys"]
    obs = "You picked up the key. <tool_response>x</tool_response>"
    assert fmt.glue(obs, True) == want["glue_ended"]
    assert fmt.glue_step(obs, {}, True) == want["glue_ended"]
    assert fmt.glue_step(obs, {TOOL_RESULTS: []}, True) == want["glue_ended"]  # no results: a user turn
    assert fmt.glue("Nothing happens.", False) == want["glue_cut"]
    assert fmt.action_reply_ids("go forward", ["\n"] if prefix else []) == want["action_reply"]
    assert fmt.end_of_turn_ids == want["end_of_turn_ids"]


# -- the probe ------------------------------------------------------------------------------------
def test_probe_tells_native_templates_from_the_others(tiny_tok, qwen_tok):
    assert ChatFormatter(tiny_tok).native_tools is False  # renders neither tools nor tool calls
    assert ChatFormatter(qwen_tok).native_tools is True


@pytest.mark.parametrize("template", [
    # raises on any tools
    "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}"
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}",
    # renders tools, but a tool-calling assistant message (its content) raises TypeError-like errors
    "{% if tools %}{{ tools | tojson }}{% endif %}"
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + m['tool_calls'] + '\n' }}{% endfor %}",
    # renders tools and messages, but drops tool calls and tool results
    "{% if tools %}{{ tools | tojson }}{% endif %}"
    "{% for m in messages %}{% if m['role'] in ['user', 'assistant', 'system'] %}"
    "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}",
    # not even valid Jinja for tools (an undefined filter)
    "{{ tools | no_such_filter }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
])
def test_probe_of_an_odd_template_never_raises_and_falls_back(tiny_path, template):
    fmt = ChatFormatter(_tok(tiny_path, template))
    assert fmt.native_tools is False


def test_probe_runs_once(qwen_tok):
    fmt = ChatFormatter(qwen_tok)
    renders = []
    real = qwen_tok.apply_chat_template

    def counting(*a, **kw):
        renders.append(kw.get("tools"))
        return real(*a, **kw)

    qwen_tok.apply_chat_template = counting
    assert fmt.native_tools and fmt.native_tools
    fmt.start(None, "hi", tools=TOOLS)
    fmt.start(None, "again", tools=TOOLS)
    assert len(renders) == 2 + 2  # the probe's two renders, then one per start


# -- fallback ---------------------------------------------------------------------------------------
def test_fallback_puts_the_tools_in_the_system_text(tiny_tok):
    fmt = ChatFormatter(tiny_tok)
    ids = fmt.start("Be brief.", "What is 1 + 2?", tools=TOOLS)
    text = tiny_tok.decode(ids, skip_special_tokens=False)
    want = tiny_tok.apply_chat_template(
        [{"role": "system", "content": tools_system_text("Be brief.", TOOLS)},
         {"role": "user", "content": "What is 1 + 2?"}], tokenize=False, add_generation_prompt=True)
    assert text == want
    system = tools_system_text("Be brief.", TOOLS)
    assert system.startswith("Be brief.\n\n# Tools")
    listed = re.search(r"<tools>\n(.*)\n</tools>", system, re.DOTALL).group(1).split("\n")
    assert [json.loads(line) for line in listed] == TOOLS
    assert "<tool_call>" in system and "</tool_call>" in system
    # no system prompt: the tool section alone
    assert tools_system_text(None, TOOLS) == system.removeprefix("Be brief.\n\n")


def test_fallback_results_are_one_user_turn_of_tool_responses(tiny_tok):
    fmt = ChatFormatter(tiny_tok)
    results = [{"tool_call_id": "call_0_0", "name": "add", "content": "3"},
               {"tool_call_id": "call_0_1", "name": "recall", "content": "memory: 3"}]
    for ended in (True, False):
        got = fmt.tool_glue(results, ended)
        assert got == fmt.glue(render_results_text(results), ended)
        assert got == fmt.glue_step("ignored: the results are glued", {TOOL_RESULTS: results}, ended)
    text = tiny_tok.decode(fmt.tool_glue(results, True), skip_special_tokens=False)
    assert "<tool_response>\n3\n</tool_response>\n<tool_response>\nmemory: 3\n</tool_response>" in text


# -- native ---------------------------------------------------------------------------------------
def _conversation(fmt: ChatFormatter, system, first_obs, replies_and_steps):
    """Ids built the rollout's way: the replies' ids as sampled (encoded alone, plus the
    end-of-turn token), then glue_step. Each step: (reply, info or None, observation)."""
    tok = fmt.tokenizer
    ids = fmt.start(system, first_obs, tools=TOOLS)
    for reply, info, obs in replies_and_steps:
        reply_ids = tok(reply, add_special_tokens=False)["input_ids"] + [fmt.end_of_turn_ids[0]]
        ids += reply_ids
        if obs is not None:
            ids += fmt.glue_step(obs, info, fmt.ends_turn(reply_ids))
    return ids


def _replies():
    add = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    recall = '<tool_call>\n{"name": "recall", "arguments": {}}\n</tool_call>'
    return [f"I will add.\n{add}", f"Both.\n{add}\n{recall}", "This is no call", "The answer is 3."]


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_native_conversation_equals_the_templates_full_render(qwen_tok, system):
    """Reply texts written as Qwen2.5 renders an assistant tool call (content, then each call
    on its own lines): the incrementally built ids decode to exactly the template's rendering of
    the whole conversation, tool messages included."""
    fmt = ChatFormatter(qwen_tok)
    r1, r2, r3, r4 = _replies()
    calls1, res1 = _calls(r1, 0)
    calls2, res2 = _calls(r2, 1)
    steps = [(r1, {TOOL_CALLS: calls1, TOOL_RESULTS: res1}, render_results_text(res1)),
             (r2, {TOOL_CALLS: calls2, TOOL_RESULTS: res2}, render_results_text(res2)),
             (r3, {"format_error": True}, "Your reply made no tool call."),
             (r4, None, None)]
    ids = _conversation(fmt, system, "What is 1 + 2?", steps)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "What is 1 + 2?"}]
    for (reply, info, obs) in steps:
        calls, text = parse_tool_calls(reply)
        if calls:
            messages.append({"role": "assistant", "content": text,
                             "tool_calls": [ToolCall(c.name, c.arguments, c.id).as_message_call() for c in calls]})
            messages += [{"role": "tool", "tool_call_id": r["tool_call_id"], "name": r["name"], "content": r["content"]}
                         for r in info[TOOL_RESULTS]]
        else:
            messages.append({"role": "assistant", "content": reply})
            if obs is not None:
                messages.append({"role": "user", "content": obs})
    full = qwen_tok.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    built = qwen_tok.decode(ids, skip_special_tokens=False)
    assert built + "\n" == full  # the full render closes the last turn with '<|im_end|>\n'
    # the replies are in the ids as sampled: never re-encoded with their context
    for reply in _replies():
        reply_ids = qwen_tok(reply, add_special_tokens=False)["input_ids"]
        assert any(ids[i:i + len(reply_ids)] == reply_ids for i in range(len(ids)))


def test_fallback_conversation_equals_the_full_render_of_its_messages(tiny_tok):
    """The fallback conversation is an ordinary one: the system text with the tools, the results
    as user turns of <tool_response> blocks."""
    fmt = ChatFormatter(tiny_tok)
    r1, r2, r3, r4 = _replies()
    calls1, res1 = _calls(r1, 0)
    steps = [(r1, {TOOL_CALLS: calls1, TOOL_RESULTS: res1}, "anything: the results are glued"),
             (r3, {"format_error": True}, "Your reply made no tool call."), (r4, None, None)]
    ids = _conversation(fmt, "Be brief.", "What is 1 + 2?", steps)
    messages = [{"role": "system", "content": tools_system_text("Be brief.", TOOLS)},
                {"role": "user", "content": "What is 1 + 2?"},
                {"role": "assistant", "content": r1}, {"role": "user", "content": render_results_text(res1)},
                {"role": "assistant", "content": r3}, {"role": "user", "content": "Your reply made no tool call."},
                {"role": "assistant", "content": r4}]
    full = tiny_tok.apply_chat_template(messages, tokenize=False)
    built = tiny_tok.decode(ids, skip_special_tokens=False)
    rest = fmt.assistant_suffix[len(tiny_tok.convert_ids_to_tokens(fmt.end_of_turn_ids[0])):]
    assert built + rest == full


def test_native_glue_is_the_templates_own(tiny_path):
    """A variant of Qwen2.5's template that renders results as a ``tool`` role turn: the glue
    follows the template (the fallback's would be a user turn)."""
    variant = QWEN25.replace("{{- '<|im_start|>user' }}", "{{- '<|im_start|>tool' }}")
    assert variant != QWEN25
    fmt = ChatFormatter(_tok(tiny_path, variant))
    results = [{"tool_call_id": "call_0_0", "name": "add", "content": "3"}]
    text = fmt.tokenizer.decode(fmt.tool_glue(results, True), skip_special_tokens=False)
    assert text == "\n<|im_start|>tool\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    cut = fmt.tokenizer.decode(fmt.tool_glue(results, False), skip_special_tokens=False)
    assert cut == "<|im_end|>" + text


def test_a_template_refusing_several_calls_still_glues_their_results(tiny_path):
    """Llama 3.1's template raises on an assistant message with more than one call; the results
    of a reply with two calls are rendered after a single probe call."""
    variant = QWEN25.replace("{%- for tool_call in message.tool_calls %}",
                             "{%- if message.tool_calls | length != 1 %}{{ raise_exception('single calls only') }}"
                             "{%- endif %}{%- for tool_call in message.tool_calls %}")
    fmt = ChatFormatter(_tok(tiny_path, variant))
    assert fmt.native_tools
    results = [{"tool_call_id": "call_0_0", "name": "add", "content": "3"},
               {"tool_call_id": "call_0_1", "name": "recall", "content": "memory: 3"}]
    text = fmt.tokenizer.decode(fmt.tool_glue(results, True), skip_special_tokens=False)
    assert "<tool_response>\n3\n</tool_response>\n<tool_response>\nmemory: 3\n</tool_response>" in text


_CLOSE = "{{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}"


@pytest.mark.parametrize("close, error", [
    # the tool-calling turn is rendered otherwise once tool results follow it
    ("{{- '<|im_end|>\\n\\n' if loop.last else '<|im_end|>\\n' }}", "re-renders earlier turns"),
    # a tool-calling turn closed otherwise than a plain one
    ("{{- '<|endoftext|>\\n' }}", "differently from a plain one"),
])
def test_native_glue_refuses_templates_it_cannot_extend(tiny_path, close, error):
    assert _CLOSE in QWEN25
    fmt = ChatFormatter(_tok(tiny_path, QWEN25.replace(_CLOSE, close + _CLOSE[_CLOSE.index("\n"):])))
    assert fmt.native_tools
    with pytest.raises(ChatTemplateError, match=error):
        fmt.tool_glue([{"tool_call_id": "call_0_0", "name": "add", "content": "3"}], True)


def test_glue_step_uses_the_calls_names(tiny_path):
    """Templates that name the tool in its result (gpt-oss's does) get the step's calls: a
    template rendering the last call's name into the tool turn shows the real name."""
    variant = QWEN25.replace("{{- '\\n<tool_response>\\n' }}",
                             "{{- '\\n<tool_response name=' + messages[loop.index0 - 1].tool_calls[0].function.name"
                             " + '>\\n' }}")
    assert variant != QWEN25
    fmt = ChatFormatter(_tok(tiny_path, variant))
    calls, results = _calls('<tool_call>{"name": "recall", "arguments": {}}</tool_call>', 3)
    text = fmt.tokenizer.decode(fmt.glue_step("x", {TOOL_CALLS: calls, TOOL_RESULTS: results}, True))
    assert "<tool_response name=recall>" in text
    # without the calls, they are made up from the results' ids and names: the same glue
    assert fmt.tool_glue(results, True) == fmt.tool_glue(results, True, calls)


def test_tool_call_actions_are_replies_as_they_are(tiny_tok):
    """A listed action (or an expert's) that holds a <tool_call> block is the reply itself: the
    ReAct wrapper would repeat the block, making two calls of one."""
    fmt = ChatFormatter(tiny_tok)
    action = 'I will add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    ids = fmt.action_reply_ids(action, [])
    assert ids == tiny_tok(action, add_special_tokens=False)["input_ids"] + fmt.end_of_turn_ids[:1]
    calls, _ = parse_tool_calls(fmt.reply_text(ids))
    assert [c.name for c in calls] == ["add"]
