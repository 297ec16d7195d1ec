"""A TextWorldExpress expert: the game's gold action sequence (``getGoldActionSequence``, via
``TextWorldExpressEnv.gold_actions()``), made shorter.

The gold path of the coin game wanders: it often steps into a room and straight back out
(``move west``, ``move east``) before heading for the coin. Two consecutive opposite moves
leave the player where it was and change nothing else, so they are cut (repeatedly, which also
removes longer there-and-back detours); the leading ``look around`` is dropped as well (the
first observation is its answer). Tested (``tests/env_adapters/test_experts.py``): the coin
game of ``configs/textworld_express.yaml`` (numLocations=4, includeDoors=0), task ids 0..39,
within its first stage's horizon of 4 turns (at least 90 %), and cookingworld with default
params, task ids 0..4, within 60 turns.
"""

from __future__ import annotations

from env_adapters.experts.gold import GoldSequenceExpert

_OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}


def cut_detours(actions: list[str]) -> list[str]:
    """``actions`` without pairs of consecutive opposite moves (``move north``, ``move south``)."""
    out: list[str] = []
    for a in actions:
        words = a.split()
        if (out and len(words) == 2 and words[0] == "move"
                and out[-1] == "move " + _OPPOSITE.get(words[1], "")):
            out.pop()  # back where the previous move started
        else:
            out.append(a)
    return out


class TextWorldExpressExpert(GoldSequenceExpert):
    def shorten(self, actions: list[str]) -> list[str]:
        return cut_detours(super().shorten(actions))
