"""Text environments for agent RL: in-process adapters and the AgentGym HTTP protocol."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from env_adapters.base import InfraError, StepResult, TextEnv, format_error

# name -> "module:Class". A plain table, not a plugin system: adding an environment is one line.
ADAPTERS: dict[str, str] = {
    "keyword": "env_adapters.keyword:KeywordEnv",
    "babyai": "env_adapters.babyai:BabyAIEnv",
    "textcraft": "env_adapters.textcraft:TextCraftEnv",
    "sciworld": "env_adapters.sciworld:SciWorldEnv",
    "textworld": "env_adapters.textworld_express:TextWorldExpressEnv",
    "deepsearch": "env_adapters.deepsearch:DeepSearchEnv",
    # MiniWoB++ pages in headless Chromium, WebArena's accessibility tree and actions
    "miniwob": "env_adapters.miniwob:MiniWoBEnv",
    # BFCL v4 multi-turn (bfcl-eval's API classes and data): tool calls, kwargs {reward}
    "bfcl": "env_adapters.bfcl:BFCLEnv",
    # any MCP server over stdio (tool calls): kwargs {task_file, work_root, call_timeout_s, ...}
    "mcp": "env_adapters.mcp_env:MCPEnv",
    # a remote AgentGym server: kwargs {base_url, env_name, dialect}
    "http": "env_adapters.http_client:HTTPEnv",
    # an agent program played through the OpenAI-compatible gateway (agentgym.gateway.agents),
    # not stepped by the rollout: kwargs {entrypoint, tasks | task_file, timeout_s, workers}
    "agent": "env_adapters.agent:AgentEnv",
}


def is_known(name: str) -> bool:
    """A registered adapter name, or a ``package.module:Class`` import path (your own adapter)."""
    return name in ADAPTERS or ":" in name


def adapter_class(name: str) -> type[TextEnv]:
    """The adapter class registered as ``name`` (or at the import path ``name``)."""
    if not is_known(name):
        raise ValueError(
            f"unknown environment {name!r}; choose one of {sorted(ADAPTERS)} "
            "or give your adapter's import path, package.module:Class"
        )
    module_name, cls_name = ADAPTERS.get(name, name).split(":")
    return getattr(importlib.import_module(module_name), cls_name)


def make_env(name: str, **kwargs: Any) -> TextEnv:
    """Instantiate the adapter registered as ``name`` (or at the import path ``name``) with its
    keyword arguments."""
    return adapter_class(name)(**kwargs)


def task_category(name: str, task_id: int, kwargs: Mapping[str, Any] | None = None) -> str:
    """The category of ``task_id`` in environment ``name`` (its adapter's ``task_category``).
    A remote ``http`` environment is categorised by its ``env_name`` keyword argument, through
    the local adapter of that name when there is one."""
    if name == "http":
        remote = str((kwargs or {}).get("env_name") or "http").lower()
        return adapter_class(remote).task_category(task_id) if remote in ADAPTERS else remote
    return adapter_class(name).task_category(task_id)


__all__ = ["ADAPTERS", "InfraError", "StepResult", "TextEnv", "adapter_class", "format_error", "is_known",
           "make_env", "task_category"]
