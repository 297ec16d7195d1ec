"""The function-call contract (env_adapters/tool_calls.py): the <tool_call> parser, ToolEnv's
step (results in info, malformed calls as format errors, refused calls as results), and the
shape checks the rollout, the HTTP client and the conformance checker apply."""

from __future__ import annotations

import json

import pytest

from calc_tool_env import CalcToolEnv, call_text  # tests/ is on sys.path
from env_adapters.tool_calls import (
    MAX_CALLS_PER_REPLY,
    TOOL_CALLS,
    TOOL_RESULTS,
    ToolCallFormatError,
    checked_tool_results,
    checked_tools,
    parse_tool_calls,
    render_results_text,
)


def test_parse_reads_blocks_ids_and_the_text_around():
    reply = f"Let me add.\n{call_text('add', a=1, b=2)}\nand {call_text('recall')} done"
    calls, text = parse_tool_calls(reply, turn=3)
    assert [(c.name, c.arguments, c.id) for c in calls] == [("add", {"a": 1, "b": 2}, "call_3_0"),
                                                           ("recall", {}, "call_3_1")]
    assert text == "Let me add.\n\nand  done"
    # OpenAI's form: arguments as a JSON string; "parameters" as Llama 3.1 writes it
    calls, _ = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert calls[0].arguments == {"x": 1}
    calls, _ = parse_tool_calls('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>')
    assert calls[0].arguments == {"x": 1}
    assert parse_tool_calls("no call at all") == ([], "no call at all")
    assert json.loads(calls[0].as_openai()["function"]["arguments"]) == {"x": 1}


@pytest.mark.parametrize("reply, why", [
    ('<tool_call>{"name": "f", "arguments": {}}', "not closed"),
    ("<tool_call>{nope}</tool_call>", "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
    ('<tool_call>["f"]</tool_call>', '"name"'),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "f", "arguments": "[1"}</tool_call>', "not a JSON object"),
    ('<tool_call>{"name": "f"}</tool_call>' * (MAX_CALLS_PER_REPLY + 1), "more than"),
    ("<tool_call>" + "[" * 100_000 + "</tool_call>", "too deeply"),  # RecursionError in json, not a crash
    ('<tool_call>{"name": "f", "arguments": "' + "[" * 100_000 + '"}</tool_call>', "not a JSON object"),
])
def test_parse_refuses_malformed_calls_with_a_message_for_the_model(reply, why):
    with pytest.raises(ToolCallFormatError, match=why):
        parse_tool_calls(reply)


def test_tool_env_step_results_format_errors_and_refusals():
    env = CalcToolEnv()
    obs, _ = env.reset(2)
    assert obs == "Task 2: what is 3 + 4?"
    res = env.step(f"{call_text('add', a=3, b=4)}{call_text('recall')}")
    assert not res.info["format_error"] and not res.terminated and res.reward == 0.0
    assert res.info[TOOL_RESULTS] == [{"tool_call_id": "call_0_0", "name": "add", "content": "7"},
                                      {"tool_call_id": "call_0_1", "name": "recall", "content": "memory: 7"}]
    assert [c["id"] for c in res.info[TOOL_CALLS]] == ["call_0_0", "call_0_1"]
    assert res.observation == render_results_text(res.info[TOOL_RESULTS])
    assert checked_tool_results(res.info) == res.info[TOOL_RESULTS]
    # no call, a malformed call: format errors, the turn consumed
    for bad in ("7", "<tool_call>{oops</tool_call>"):
        r = env.step(bad)
        assert r.info["format_error"] and TOOL_RESULTS not in r.info and r.reward == 0.0
    # a refused call is a result the model reads, flagged invalid
    r = env.step(call_text("multiply", a=1, b=2))
    assert r.info["invalid_action"] and "unknown tool" in r.info[TOOL_RESULTS][0]["content"]
    assert r.info[TOOL_RESULTS][0]["tool_call_id"] == "call_3_0"  # turn 3 of the episode
    # a call that ends the episode stops the reply's later calls
    r = env.step(f"{call_text('submit', answer=7)}{call_text('recall')}")
    assert r.terminated and r.reward == 1.0 and r.info["success"]
    assert len(r.info[TOOL_RESULTS]) == len(r.info[TOOL_CALLS]) == 1


def test_checked_tools():
    tools = CalcToolEnv().tools()
    assert checked_tools(tools) is tools
    assert checked_tools(None) is None and checked_tools([]) is None
    bad = [
        ("tools", "must return None or a list"),
        ([{"type": "function"}], '"type": "function"'),
        ([{"function": {"name": "f"}}], '"type": "function"'),
        ([{"type": "function", "function": {"name": ""}}], "no name"),
        (tools + tools[:1], "appears twice"),
        ([{"type": "function", "function": {"name": "f", "description": 3}}], "description"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "parameters"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "default": object()}}}],
         "JSON-serializable"),
    ]
    for value, why in bad:
        with pytest.raises(ValueError, match=why):
            checked_tools(value)


def test_checked_tool_results():
    results = [{"tool_call_id": "call_0_0", "name": "add", "content": "3"}]
    calls = [{"id": "call_0_0", "type": "function", "function": {"name": "add", "arguments": "{}"}}]
    assert checked_tool_results({}) is None and checked_tool_results({TOOL_RESULTS: []}) is None
    assert checked_tool_results({TOOL_RESULTS: results}) == results
    assert checked_tool_results({TOOL_RESULTS: results, TOOL_CALLS: calls}) == results
    bad = [
        ({TOOL_RESULTS: "3"}, "must be a list"),
        ({TOOL_RESULTS: [{"tool_call_id": "c", "name": "add", "content": 3}]}, "tool result 0"),
        ({TOOL_RESULTS: [{"name": "add", "content": "3"}]}, "tool result 0"),
        ({TOOL_RESULTS: results, TOOL_CALLS: calls * 2}, "one call per result"),
        ({TOOL_RESULTS: results, TOOL_CALLS: [{"id": "call_0_0"}]}, "tool call 0 must be"),
        ({TOOL_RESULTS: results, TOOL_CALLS: [{**calls[0], "id": "other"}]}, "does not match"),
    ]
    for info, why in bad:
        with pytest.raises(ValueError, match=why):
            checked_tool_results(info)
