"""An OpenAI-compatible gateway to the policy: agents written with the ``openai`` client (or any
framework that speaks its chat API) play episodes that are recorded token-in, token-out and
trained like the rollout's.

* ``messages``: requests validated and normalized, message lists rendered fresh, replies as
  OpenAI messages (``tool_calls``);
* ``recorder``: :class:`~agentgym.gateway.recorder.Gateway`, the episodes and their ids, served
  from the engine through one batching :class:`~agentgym.gateway.recorder.EngineWorker`;
* ``server``: the HTTP app (``/episodes/{id}/v1/chat/completions``, ``/reward``, ``/end``) and
  :class:`~agentgym.gateway.server.GatewayServer` (uvicorn in a thread);
* ``agents``: the ``agent`` environment kind (``env_adapters.agent``) the pipeline plays through it.

``agentgym gateway serve -c CONFIG --port P`` (``agentgym_cli/gateway_cmd.py``) serves a config's
policy and writes ended episodes to its trajectory store.
"""
