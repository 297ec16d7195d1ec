"""A trivially learnable environment for sanity checks of the whole RL loop.

``mode="starts_with"``: the agent must reply with a word that starts with ``target``; a wrong
reply gets a retry prompt (multi-turn), a right one ends the episode with reward 1.

``mode="char_share"``: one turn; the reward is the share of the reply's non-space characters
that are in ``target`` (a dense reward a randomly initialised model can climb: used by the
learning sanity tests, where a 1-in-500 exact word would give no signal).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from env_adapters.base import StepResult, TextEnv, format_error

MAX_REPLY_CHARS = 2000


class KeywordEnv(TextEnv):
    name = "keyword"

    def __init__(self, target: str = "yes", mode: Literal["starts_with", "char_share"] = "starts_with",
                 step_delay_s: float = 0.0):
        if not target:
            raise ValueError("keyword env: target must be a non-empty string")
        if mode not in ("starts_with", "char_share"):
            raise ValueError(f"keyword env: mode must be 'starts_with' or 'char_share', got {mode!r}")
        if step_delay_s < 0:
            raise ValueError(f"keyword env: step_delay_s must be >= 0, got {step_delay_s}")
        self.target = target
        self.mode = mode
        # seconds each step waits, as a remote environment server would (tests and benchmarks of
        # rollout concurrency: bench/rollout_scaling.py)
        self.step_delay_s = float(step_delay_s)
        self._task = -1
        self._done = True

    def system_prompt(self) -> str:
        return "You are a helpful assistant. Follow the instruction exactly."

    def _instruction(self) -> str:
        if self.mode == "char_share":
            return f"Task {self._task}: write a reply using only the letters '{self.target}'."
        return f"Task {self._task}: reply with the word '{self.target}'."

    def reset(self, task_id: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
        self._task = int(task_id)
        self._done = False
        return self._instruction(), {"task_id": self._task, "seed": seed}

    def valid_actions(self) -> list[str] | None:
        return [self.target]

    def step(self, action_text: str) -> StepResult:
        if self._done:
            raise RuntimeError("keyword env: step() after the episode ended; call reset()")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        reply = action_text.strip()
        if reply.lower().startswith("action:"):  # accept the ReAct form too
            reply = reply[len("action:"):].strip()
        if not any(c.isalnum() for c in reply) or len(reply) > MAX_REPLY_CHARS:
            return format_error("Your reply was empty, unreadable or too long. " + self._instruction(),
                                parsed_action=None, success=False)
        if self.mode == "char_share":
            chars = [c for c in reply if not c.isspace()]
            share = sum(c in self.target for c in chars) / len(chars)
            self._done = True
            return StepResult("Done.", float(share), True, False,
                              {"parsed_action": reply, "success": share >= 0.999, "format_error": False})
        ok = reply.lower().startswith(self.target.lower())
        self._done = ok
        obs = "Correct." if ok else f"Wrong. {self._instruction()}"
        # a wrong word is an action the environment does not list (valid_actions() is the
        # target): flagged like any adapter's invalid action, so wasted turns count alike
        return StepResult(obs, 1.0 if ok else 0.0, ok, False,
                          {"parsed_action": reply.split()[0] if reply.split() else None,
                           "success": ok, "format_error": False, "invalid_action": not ok})
