"""A ScienceWorld expert: the simulator's gold action sequence, replayed in order.

``scienceworld`` generates a gold path for every task variation
(``ScienceWorldEnv.get_gold_action_sequence``, reached through ``SciWorldEnv.gold_actions()``);
:class:`~env_adapters.experts.gold.GoldSequenceExpert` reloads the task with it when the
environment was created without ``gold_path=True`` and drops the leading ``look around`` (the
adapter's reset already did it). Tested (``tests/env_adapters/test_experts.py``): success
(score 100) on five task types with short gold paths. Gold paths differ in length by task type
(boiling, melting or measuring take far more turns than finding a thing), so the horizon must
allow the whole sequence.
"""

from __future__ import annotations

from env_adapters.experts.gold import GoldSequenceExpert


class SciWorldExpert(GoldSequenceExpert):
    pass
