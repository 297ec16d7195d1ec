"""Agents for the gateway's tests (a test helper, not a test module; tests/ is on ``sys.path``):
entrypoints ``gateway_agents:<name>`` for the ``agent`` environment kind, each written with the
``openai`` client against the episode's base URL.

* :func:`mirror_calc` plays ``calc_tool_env.CalcToolEnv`` as the rollout loop does: the env's
  system prompt, first observation and tools; each reply stepped in the env (its tool calls
  written back as ``<tool_call>`` blocks), tool results sent as ``tool`` messages, any other
  observation as a user message; ``task["horizon"]`` replies at most;
* the others fail in one way each (raise, return garbage, post the reward and return None,
  hang past the timeout, make no model call).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
from openai import OpenAI

import calc_tool_env
from env_adapters.tool_calls import TOOL_RESULTS


def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=base_url, api_key="test", max_retries=0, timeout=120.0)


def mirror_calc(base_url: str, task: dict[str, Any]) -> dict[str, Any]:
    """The rollout loop's conversation with CalcToolEnv, through the gateway; the env's reward."""
    env = calc_tool_env.CalcToolEnv()
    obs, _ = env.reset(task["task_id"], task["seed"])
    messages: list[Any] = [{"role": "system", "content": env.system_prompt()}, {"role": "user", "content": obs}]
    c = client(base_url)
    reward = 0.0
    for _ in range(task["horizon"]):
        reply = c.chat.completions.create(model="policy", messages=messages, tools=env.tools(),
                                          max_tokens=task["max_tokens"])
        msg = reply.choices[0].message
        text = msg.content or ""
        for call in msg.tool_calls or []:  # the reply as the env reads it: content, then the calls
            text += ("\n" if text else "") + calc_tool_env.call_text(call.function.name,
                                                                     **json.loads(call.function.arguments))
        res = env.step(text)
        reward += res.reward
        if res.terminated or res.truncated:
            break
        messages.append(msg.model_dump(exclude_none=True))
        results = res.info.get(TOOL_RESULTS)
        if results:
            messages += [{"role": "tool", "tool_call_id": r["tool_call_id"], "content": r["content"]} for r in results]
        else:
            messages.append({"role": "user", "content": res.observation})
    return {"reward": reward, "success": reward >= 1.0}


def _say(base_url: str, text: str = "hi") -> str:
    reply = client(base_url).chat.completions.create(model="policy", messages=[{"role": "user", "content": text}])
    return reply.choices[0].message.content or ""


def raises(base_url: str, task: dict[str, Any]) -> float:
    _say(base_url)
    raise RuntimeError("the agent's own bug")


def garbage(base_url: str, task: dict[str, Any]) -> Any:
    _say(base_url)
    return "not a reward"


def posts_reward(base_url: str, task: dict[str, Any]) -> None:
    _say(base_url)
    root = base_url.rsplit("/v1", 1)[0]
    httpx.post(f"{root}/reward", json={"reward": 0.25, "success": False}).raise_for_status()
    httpx.post(f"{root}/end").raise_for_status()  # ended by the agent; its reward stays
    return None


HANG = threading.Event()


def hangs(base_url: str, task: dict[str, Any]) -> float:
    _say(base_url)
    HANG.wait(30)
    return 1.0


def silent(base_url: str, task: dict[str, Any]) -> float:
    return 1.0  # never asks the model: nothing to train on

