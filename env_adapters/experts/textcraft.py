"""A TextCraft expert: a recipe-tree planner over the adapter's crafting tree and inventory.

At every turn it plans from the current inventory (so it also recovers from a turn that was not
its own, e.g. a DART noise action) and plays the plan's first command:

1. ``need(goal, 1)``: an item already held is used; a base (non-craftable) item is *got*; a
   craftable one is crafted with the recipe of smallest depth (ties: fewest ingredients), once
   per batch of its output count, after its ingredients, recursively (bottom-up). Leftovers of a
   batch (4 planks from 1 log) serve later needs.
2. A generic ingredient (a tag such as ``planks``) is named by a concrete kind: one already held,
   else the kind chosen before for that tag, else the one of smallest depth (then name) that
   the tree can craft or get.
3. The plan is the base items with their exact total counts (``get 3 oak log``: one command per
   item), then the crafts in bottom-up order, the goal last.

Tested (``tests/env_adapters/test_experts.py``) over all 544 goals, within a horizon of 2 x
(number of crafts) + 2: at least 95 % of the 416 goals of depth 1-2 and 90 % of the 128 of
depth 3-4 are crafted; with 30 % random valid actions mixed in, at least 90 % of 136 goals.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from env_adapters.base import TextEnv
from env_adapters.experts.base import Expert
from env_adapters.textcraft import item_id_to_str


class _NoPlan(Exception):
    pass


class Planner:
    """The commands that craft ``goal`` from ``inventory`` with ``tree`` (a ``CraftingTree``)."""

    def __init__(self, tree: Any) -> None:
        self.tree = tree

    def plan(self, goal: str, inventory: dict[str, int]) -> list[str]:
        self.have: Counter[str] = Counter(inventory)
        self.gets: dict[str, int] = {}
        self.crafts: list[str] = []
        self.kinds: dict[str, str] = {}  # tag -> the concrete kind used for it
        try:
            self._need(goal, 1, frozenset())
        except _NoPlan:
            return []
        gets = [f"get {n} {item_id_to_str(i)}" for i, n in self.gets.items()]
        return gets + self.crafts

    # ------------------------------------------------------------------ internals
    def _gettable(self, item: str) -> bool:
        t = self.tree
        return not t.is_craftable(item) and t.is_valid_item(item) and not t.is_tag(item)

    def _depth(self, item: str) -> int:
        return self.tree.get_min_depth(item)

    def _need(self, item: str, n: int, path: frozenset[str]) -> None:
        used = min(self.have[item], n)
        self.have[item] -= used
        n -= used
        if n == 0:
            return
        if self._gettable(item):
            self.gets[item] = self.gets.get(item, 0) + n
            return
        recipe = self._recipe(item, path)
        out = recipe.output_item.count
        batches = math.ceil(n / out)
        path = path | {item}
        inputs = [(self._kind(inp.item_tag, path), inp.count) for inp in recipe.input_items]
        command = f"craft {out} {item_id_to_str(item)} using " + ", ".join(
            f"{c} {item_id_to_str(i)}" for i, c in inputs)
        for _ in range(batches):
            for kind, count in inputs:
                self._need(kind, count, path)
            self.crafts.append(command)
        self.have[item] += batches * out - n

    def _recipe(self, item: str, path: frozenset[str]) -> Any:
        """The easiest recipe of ``item`` whose ingredients are not being crafted already."""
        options = [r for r in self.tree.itemid_recipes.get(item, [])
                   if not any(inp.item_tag.name in path for inp in r.input_items)]
        if not options:
            raise _NoPlan(item)
        return min(options, key=lambda r: (max(self._depth(i.item_tag.name) for i in r.input_items),
                                           len(r.input_items)))

    def _kind(self, tag: Any, path: frozenset[str]) -> str:
        """The concrete item to name for ingredient ``tag`` (an ``ItemTag``)."""
        if tag.item_id is not None:
            return tag.item_id
        if tag.tag in self.kinds:
            return self.kinds[tag.tag]
        t = self.tree
        kinds = sorted(i for i, g in t.item_id_to_tag.items() if g == tag.tag and i not in path
                       and (i in t.itemid_recipes or self._gettable(i)))
        if not kinds:
            raise _NoPlan(tag.tag)
        held = [k for k in kinds if self.have[k] > 0]
        choice = max(held, key=lambda k: self.have[k]) if held else min(
            kinds, key=lambda k: (self._depth(k), k))
        self.kinds[tag.tag] = choice
        return choice


class TextCraftExpert(Expert):
    def __init__(self) -> None:
        self._env: Any = None
        self.plan: list[str] = []  # the plan made at reset (for the tests: its length)

    def reset(self, env: TextEnv, observation: str, info: dict[str, Any]) -> None:
        self._env = env
        self.plan = Planner(env._r.tree).plan(env.goal, env.inventory)  # type: ignore[attr-defined]

    def act(self, observation: str) -> str | None:
        env = self._env
        plan = Planner(env._r.tree).plan(env.goal, env.inventory)
        return plan[0] if plan else None
