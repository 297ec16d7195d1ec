"""A ScienceWorld expert: the simulator's gold action sequence, replayed in order.

``scienceworld`` generates a gold path for every task variation
(``ScienceWorldEnv.get_gold_action_sequence``, reached through ``SciWorldEnv.gold_actions()``);
:class:`~env_adapters.experts.gold.GoldSequenceExpert` reloads the task with it when the
environment was created without ``gold_path=True`` and drops the leading ``look around`` (the
adapter's reset already did it). Measured: success (score 100) on all 46 tasks tried, the
variations 1 and 2 of each of the 23 task types, in 2 (find-non-living-thing) to 93
(measure-melting-point-unknown-substance) turns -- all under the simulator's 100-move limit, but
boiling, melting or measuring takes 25-93 turns, so the horizon must allow the whole sequence.
"""

from __future__ import annotations

from env_adapters.experts.gold import GoldSequenceExpert


class SciWorldExpert(GoldSequenceExpert):
    pass
