"""AgentGym-RL core library: config, rollout, algorithms, training, store, tracking.

Imports no Prefect: flows/ and tasks/ wrap this library, never the other way round.
"""

__version__ = "0.1.0"
