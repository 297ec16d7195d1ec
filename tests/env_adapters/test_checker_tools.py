"""The conformance checker on tool environments: a good one passes (its scripted run calls tools
made from their schemas), and each broken one is named by the violation."""

from __future__ import annotations

import itertools
import random

import pytest

from calc_tool_env import CalcToolEnv  # tests/ is on sys.path
from env_adapters.base import StepResult, TextEnv, format_error
from env_adapters.checker import TOOL_GARBAGE_REPLIES, UNKNOWN_TOOL_REPLY, check_env, tool_call_reply
from env_adapters.tool_calls import TOOL_RESULTS, ToolCallFormatError, parse_tool_calls


def test_a_good_tool_env_passes_and_its_script_calls_tools():
    report = check_env(lambda: CalcToolEnv(), [0, 1], horizon=4)
    assert report["steps"] > 0
    calls = [parse_tool_calls(tool_call_reply(CalcToolEnv().tools(), random.Random(s)))[0][0] for s in range(20)]
    assert {c.name for c in calls} == {"add", "recall", "submit"}
    assert all(c.arguments == ({"a": 1, "b": 1} if c.name == "add" else {"answer": 1} if c.name == "submit" else {})
               for c in calls)
    # listed tool-call actions are sent as they are (not inside a ReAct "Action:" line)
    assert check_env(lambda: CalcToolEnv(listed="all"), [0], horizon=4, check_resources=False)["steps"] > 0


def test_tool_garbage_is_malformed_for_the_parser():
    for junk in TOOL_GARBAGE_REPLIES:
        with pytest.raises(ToolCallFormatError):
            parse_tool_calls(junk)
    assert parse_tool_calls(UNKNOWN_TOOL_REPLY)[0][0].name == "zzqx_no_such_tool"


class _DuplicateTools(CalcToolEnv):
    def tools(self):
        return super().tools() + super().tools()[:1]


_counter = itertools.count()


class _ToolsDifferPerInstance(CalcToolEnv):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.k = next(_counter)

    def tools(self):
        tools = super().tools()
        tools[0]["function"]["description"] += f" ({self.k})"
        return tools


class _RaisesOnMalformedCalls(TextEnv):
    """Offers tools but parses replies itself, and raises on bad JSON."""

    name = "raises_on_calls"

    def reset(self, task_id, seed=0):
        return "call f", {}

    def tools(self):
        return CalcToolEnv().tools()

    def step(self, action_text):
        if "<tool_call>" not in action_text or "</tool_call>" not in action_text:
            return format_error("call a tool")
        import json
        body = action_text.split("<tool_call>")[1].split("</tool_call>")[0]
        json.loads(body)  # raises on the checker's bad JSON
        return StepResult("ok", 0.0, False, False, {"format_error": False})


class _ResultsNotMatchingCalls(CalcToolEnv):
    def step(self, action_text):
        res = super().step(action_text)
        for r in res.info.get(TOOL_RESULTS) or []:
            r["tool_call_id"] = "someone-else"
        return res


class _ResultsWithoutObservation(CalcToolEnv):
    def step(self, action_text):
        res = super().step(action_text)
        if res.info.get(TOOL_RESULTS):
            res.observation = ""
        return res


class _UnknownToolIsFine(CalcToolEnv):
    """Answers a call of a tool it does not have like a successful call."""

    def call_tool(self, call):
        from env_adapters.tool_calls import ToolOutcome
        if call.name == "zzqx_no_such_tool":
            return ToolOutcome("ok")
        return super().call_tool(call)


@pytest.mark.parametrize("cls, violation", [
    (_DuplicateTools, "tools\\(\\) is malformed: tool name 'add' appears twice"),
    (_ToolsDifferPerInstance, "offer different tools\\(\\)"),
    (_RaisesOnMalformedCalls, "step raised JSONDecodeError"),
    (_ResultsNotMatchingCalls, "malformed tool results: tool call 0 .* does not match its result"),
    (_ResultsWithoutObservation, "must also give them as the observation text"),
    (_UnknownToolIsFine, "must be a format error or an invalid action"),
])
def test_a_broken_tool_env_is_named(cls, violation):
    with pytest.raises(AssertionError, match=violation):
        check_env(lambda: cls(), [0], horizon=3, check_resources=False)
