"""An agent written with the ``openai`` package, trained through agentgym's gateway unchanged.

Nothing here knows about agentgym: the agent talks to an OpenAI-compatible endpoint
(``base_url``) and returns a reward. Train it with the ``agent`` environment kind::

    envs:
      - name: agent
        tasks: [0, 1, 2, 3]
        kwargs:
          entrypoint: examples.openai_agent:run
          tasks:   # task id i -> tasks[i]
            - {kind: keyword, letters: aeiou}
            - {kind: calculator, question: "What is 3 + 4?", answer: 7}
            - {kind: calculator, question: "What is 6 * 7?", answer: 42}
            - {kind: keyword, letters: xyz}

or serve a policy with ``agentgym gateway serve -c CONFIG --port 8100`` and run it by hand::

    python -m examples.openai_agent http://127.0.0.1:8100/episodes/demo-e0/v1

Two tasks:

* ``keyword``: one reply that should use only the given ``letters``; the reward is the share of
  the reply's non-space characters among them (dense: a small model gets a signal);
* ``calculator``: a question answered with tools (``add``, ``multiply``, ``submit``): the agent
  runs the model's tool calls, returns their results as ``tool`` messages, and asks again until
  the model submits an answer or ``max_turns`` pass; the reward is 1 for the right answer. A
  reply without a tool call gets a reminder as a user message.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from openai import BadRequestError, OpenAI
from openai.types.chat import ChatCompletionFunctionToolParam


def _tool(name: str, description: str, **params: str) -> ChatCompletionFunctionToolParam:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": t} for k, t in params.items()},
                       "required": list(params)}}}


TOOLS = [_tool("add", "Add two numbers.", a="number", b="number"),
         _tool("multiply", "Multiply two numbers.", a="number", b="number"),
         _tool("submit", "Submit the final answer; ends the task.", answer="number")]


def _keyword(client: OpenAI, task: dict[str, Any]) -> dict[str, Any]:
    letters = str(task.get("letters", "aeiou"))
    reply = client.chat.completions.create(
        model="policy", max_tokens=int(task.get("max_tokens", 16)),
        messages=[{"role": "system", "content": "You are a helpful assistant. Follow the instruction exactly."},
                  {"role": "user", "content": f"Write a reply using only the letters '{letters}'."}])
    chars = [c for c in reply.choices[0].message.content or "" if not c.isspace()]
    share = sum(c in letters for c in chars) / len(chars) if chars else 0.0
    return {"reward": share, "success": share >= 0.999}


def _call(name: str, args: dict[str, Any]) -> str:
    a, b = args.get("a"), args.get("b")
    if name in ("add", "multiply"):
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
            return f"Error: {name} takes two numbers, a and b"
        assert isinstance(a, (int, float)) and isinstance(b, (int, float))
        return str(a + b if name == "add" else a * b)
    return f"Error: unknown tool {name!r}; the tools are add, multiply and submit"


def _calculator(client: OpenAI, task: dict[str, Any]) -> dict[str, Any]:
    messages: list[Any] = [
        {"role": "system", "content": "You are a careful calculator. Use the tools, then submit the answer."},
        {"role": "user", "content": str(task.get("question", "What is 2 + 3?"))}]
    for _ in range(int(task.get("max_turns", 4))):
        try:
            reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                   max_tokens=int(task.get("max_tokens", 128)))
        except BadRequestError:  # the episode's horizon or context is spent
            break
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            messages.append({"role": "user", "content": "Call a tool: add, multiply, or submit with the answer."})
            continue
        for call in message.tool_calls:
            if call.type != "function":
                continue
            fn = call.function
            try:
                args = json.loads(fn.arguments or "{}")
            except json.JSONDecodeError:
                args = {}
            if fn.name == "submit":
                right = args.get("answer") == task.get("answer")
                return {"reward": 1.0 if right else 0.0, "success": right}
            messages.append({"role": "tool", "tool_call_id": call.id, "content": _call(fn.name, args)})
    return {"reward": 0.0, "success": False}


def run(base_url: str, task: dict[str, Any]) -> dict[str, Any]:
    """Play ``task`` against the model at ``base_url``; the reward and whether it succeeded."""
    client = OpenAI(base_url=base_url, api_key="agentgym", max_retries=0, timeout=600.0)
    try:
        if task.get("kind", "keyword") == "calculator":
            return _calculator(client, task)
        return _keyword(client, task)
    finally:
        client.close()


if __name__ == "__main__":  # python -m examples.openai_agent BASE_URL [TASK_JSON]
    url = sys.argv[1]
    print(run(url, json.loads(sys.argv[2]) if len(sys.argv) > 2 else {"kind": "calculator"}))
