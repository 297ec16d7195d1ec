"""A small tool environment for tests (a test helper, not a test module): a calculator with a
memory, whose actions are function calls (``env_adapters.tool_calls.ToolEnv``).

Task ``t`` asks for ``(t + 1) + (t + 2)``. Tools: ``add(a, b)`` returns the sum and keeps it in
memory, ``recall()`` returns the memory, ``submit(answer)`` ends the episode (reward 1 when the
answer is right, else 0). An unknown tool or bad arguments are a ``ToolError`` (the model reads
the error; ``info["invalid_action"]``).

``listed``: what ``valid_actions()`` lists, so that action-constrained decoding draws real tool
calls from a random model: ``"none"`` (the ``ToolEnv`` default, ``None``: free generation),
``"all"`` (every turn), ``"alternate"`` (even turns only: odd turns are generated freely, mostly
format errors). Listed at turns 0-1, 4-5, ...: an ``add`` call with a line of text before it, or
a ``recall``; at turns 2-3, 6-7, ...: only a reply with two ``add`` calls (a random model would
hardly ever choose the longest candidate). ``wrong_submit`` adds a wrong
``submit`` to the listed actions (an episode can end).

Import path for ``make_env``: ``calc_tool_env:CalcToolEnv`` (tests/ is on ``sys.path``).
"""

from __future__ import annotations

import json
from typing import Any

from env_adapters.tool_calls import ToolCall, ToolEnv, ToolError, ToolOutcome, tool_schema

PATH = "calc_tool_env:CalcToolEnv"
_INT = {"type": "integer"}


def call_text(name: str, **arguments: Any) -> str:
    """A ``<tool_call>`` block as Qwen2.5's template renders one (so a reply can equal the
    template's rendering of the assistant message)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class CalcToolEnv(ToolEnv):
    name = "calc_tools"

    def __init__(self, listed: str = "none", wrong_submit: bool = False):
        if listed not in ("none", "all", "alternate"):
            raise ValueError(f"listed must be none, all or alternate, got {listed!r}")
        self.listed, self.wrong_submit = listed, bool(wrong_submit)
        self.task, self.memory = -1, 0

    def system_prompt(self) -> str:
        return "You are a careful calculator. Use the tools."

    def tools(self) -> list[dict[str, Any]]:
        return [
            tool_schema("add", "Add two integers; the sum is kept in memory.",
                        {"type": "object", "properties": {"a": _INT, "b": _INT}, "required": ["a", "b"]}),
            tool_schema("recall", "The number in memory."),
            tool_schema("submit", "Submit the final answer; ends the episode.",
                        {"type": "object", "properties": {"answer": _INT}, "required": ["answer"]}),
        ]

    def _reset(self, task_id: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
        self.task, self.memory = int(task_id), 0
        return f"Task {task_id}: what is {task_id + 1} + {task_id + 2}?", {"task_id": task_id}

    def valid_actions(self) -> list[str] | None:
        if self.listed == "none" or (self.listed == "alternate" and self.turn % 2):
            return None
        t = self.task
        if (self.turn // 2) % 2:  # turns 2-3, 6-7, ...: a reply with two calls, the only one listed
            return [f"Two sums.\n{call_text('add', a=t, b=1)}\n{call_text('add', a=2, b=t)}"]
        actions = [f"I will add.\n{call_text('add', a=t + 1, b=t + 2)}", call_text("recall")]
        if self.wrong_submit:
            actions.append(call_text("submit", answer=-1))
        return actions

    def call_tool(self, call: ToolCall) -> ToolOutcome:
        args = call.arguments
        if call.name == "add":
            if set(args) != {"a", "b"} or not all(isinstance(args[k], int) for k in ("a", "b")):
                raise ToolError("add takes two integers, a and b")
            self.memory = args["a"] + args["b"]
            return ToolOutcome(str(self.memory))
        if call.name == "recall":
            return ToolOutcome(f"memory: {self.memory}")
        if call.name == "submit":
            if not isinstance(args.get("answer"), int):
                raise ToolError("submit takes an integer answer")
            right = args["answer"] == 2 * self.task + 3
            return ToolOutcome("correct" if right else "wrong", done=True, reward=float(right), success=right)
        raise ToolError(f"unknown tool {call.name!r}; the tools are add, recall and submit")
