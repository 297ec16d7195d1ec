"""Scripted experts: one per environment, used to write demonstrations for the SFT warm start.

An expert is a policy with privileged access to its environment (the adapter instance: its
action table, recipe tree, or the simulator's gold action sequence). It returns the *bare*
action text of each turn; :mod:`agentgym.training.demos` writes it in the reply format the policy is
trained to produce (``rollout.response_prefix`` / ReAct lines) through the same
``ChatFormatter``, so a demonstration's tokens are exactly what the policy would have sampled.

A plain table, like ``env_adapters.ADAPTERS``: adding an expert is one line.
"""

from __future__ import annotations

import importlib

from env_adapters.experts.base import Expert

EXPERTS: dict[str, str] = {
    "babyai": "env_adapters.experts.babyai:BabyAIExpert",
    "textcraft": "env_adapters.experts.textcraft:TextCraftExpert",
    "sciworld": "env_adapters.experts.sciworld:SciWorldExpert",
    "textworld": "env_adapters.experts.textworld_express:TextWorldExpressExpert",
    "deepsearch": "env_adapters.experts.deepsearch:DeepSearchExpert",
    "miniwob": "env_adapters.experts.miniwob:MiniWoBExpert",
}


def make_expert(env_name: str) -> Expert:
    """The scripted expert of environment ``env_name`` (a name of ``EXPERTS``)."""
    if env_name not in EXPERTS:
        raise ValueError(f"no scripted expert for environment {env_name!r}; experts exist for "
                         f"{sorted(EXPERTS)} (demonstrations need one)")
    module_name, cls_name = EXPERTS[env_name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)()


__all__ = ["EXPERTS", "Expert", "make_expert"]
