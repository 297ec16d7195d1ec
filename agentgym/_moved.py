"""Where the modules of the former flat ``agentgym/`` layout live now.

Code written against the flat layout keeps a clear path forward: ``agentgym.store.TrajectoryStore``
(a module attribute that is now in a submodule) still resolves, with a ``DeprecationWarning`` naming
the new import; ``import agentgym.diskspace`` (a module that became part of a package) fails with a
``ModuleNotFoundError`` naming the new module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import warnings
from typing import Any

#: former module (``agentgym.<name>``) -> its module now
MOVED = {
    "agentgym.rollout": "agentgym.rollout.loop",
    "agentgym.env_threads": "agentgym.rollout.env_threads",
    "agentgym.engines": "agentgym.rollout.engines",
    "agentgym.trainer": "agentgym.training.protocol",
    "agentgym.training": "agentgym.training.policy_trainer",
    "agentgym.sft": "agentgym.training.sft",
    "agentgym.demos": "agentgym.training.demos",
    "agentgym.distributed": "agentgym.cluster.trainer_group",
    "agentgym.dist_env": "agentgym.training.dist_env",
    "agentgym.store": "agentgym.store.trajectory_store",
    "agentgym.store_refusals": "agentgym.store.refusals",
    "agentgym.tracking": "agentgym.tracking.tracker",
    "agentgym.tracking_db": "agentgym.tracking.db_full",
    "agentgym.prefect_db": "agentgym.tracking.prefect_db",
    "agentgym.artifact_keys": "agentgym.tracking.artifact_keys",
    "agentgym.run_summary": "agentgym.tracking.run_summary",
    "agentgym.registry": "agentgym.registry.champion",
    "agentgym.policy_model": "agentgym.registry.policy_model",
    "agentgym.policy_pyfunc": "agentgym.registry.policy_pyfunc",
    "agentgym.models": "agentgym.models.folders",
    "agentgym.model_cache": "agentgym.models.cache",
    "agentgym.smollm2": "agentgym.models.smollm2",
    "agentgym.tiny_model": "agentgym.models.tiny_model",
    "agentgym.hardware": "agentgym.models.hardware",
    "agentgym.evaluation": "agentgym.evaluation.metrics",
    "agentgym.heldout": "agentgym.evaluation.before_after",
    "agentgym.learning_curve": "agentgym.evaluation.learning_curve",
    "agentgym.inspect_run": "agentgym.evaluation.inspect_run",
    "agentgym.viewer": "agentgym.evaluation.viewer",
    "agentgym.diskspace": "agentgym.infra.diskspace",
    "agentgym.tempdirs": "agentgym.infra.tempdirs",
    "agentgym.heap": "agentgym.infra.heap",
    "agentgym.progress": "agentgym.infra.progress",
}

#: former modules later split further: the other modules that now hold their public names
SPLIT = {
    "agentgym.store": ("agentgym.store.schema", "agentgym.store.manifest", "agentgym.store.episode_writer"),
    "agentgym.training": ("agentgym.training.batch", "agentgym.training.seeding", "agentgym.training.forward",
                          "agentgym.training.value_head", "agentgym.training.finite"),
}

#: former modules whose name is now a package (holding the former module as a submodule)
NOW_PACKAGES = frozenset(old for old, new in MOVED.items() if new.startswith(old + "."))


def forward(package: str, name: str) -> Any:
    """A former module's attribute, looked up on the package of the same name (PEP 562 hook).

    Only public names of the former module are forwarded; anything else raises AttributeError so
    ``from package import submodule`` still imports the submodule.
    """
    if name.startswith("_") or importlib.util.find_spec(f"{package}.{name}") is not None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    homes = [importlib.import_module(m) for m in (*SPLIT.get(package, ()), MOVED[package])]
    having = [m for m in homes if name in vars(m)]
    if not having:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    # the module that defines it (classes, functions), else the first that holds it (constants)
    module = next((m for m in having if getattr(vars(m)[name], "__module__", None) == m.__name__), having[0])
    home = module.__name__
    warnings.warn(f"{package}.{name} moved to {home}.{name}; import it from {home}",
                  DeprecationWarning, stacklevel=3)
    return getattr(module, name)


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Turns an import of a former module that no longer exists into an error naming its new home.

    Consulted last (appended to ``sys.meta_path``), so it only sees names no other finder found.
    """

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        for old, new in MOVED.items():
            if old in NOW_PACKAGES:  # its submodules are real; a missing one is a plain error
                continue
            if fullname == old or fullname.startswith(old + "."):
                raise ModuleNotFoundError(
                    f"{fullname} moved: {old} is now {new}; import "
                    f"{new + fullname[len(old):]} instead", name=fullname)
        return None
