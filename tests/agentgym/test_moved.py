"""Imports written for the former flat ``agentgym/`` layout: they keep working or name the new path."""

from __future__ import annotations

import importlib
import importlib.util

import pytest

from agentgym._moved import MOVED, NOW_PACKAGES


@pytest.mark.parametrize("old,new", sorted(MOVED.items()))
def test_every_new_home_exists(old, new):
    assert importlib.util.find_spec(new) is not None, f"{old} -> {new}: no such module"


@pytest.mark.parametrize("old", sorted(set(MOVED) - NOW_PACKAGES))
def test_a_removed_module_names_its_new_home(old):
    with pytest.raises(ModuleNotFoundError, match=f"import {MOVED[old]}"):
        importlib.import_module(old)


def test_a_removed_package_names_the_new_home_of_its_submodule():
    with pytest.raises(ModuleNotFoundError, match="agentgym.rollout.engines"):
        importlib.import_module("agentgym.engines.hf")


def test_a_former_module_attribute_resolves_with_a_warning_naming_the_new_import():
    from agentgym.store.trajectory_store import TrajectoryStore
    with pytest.warns(DeprecationWarning, match="import it from agentgym.store.trajectory_store"):
        from agentgym.store import TrajectoryStore as old  # noqa: PLC0415
    assert old is TrajectoryStore


def test_submodules_of_a_former_module_name_import_without_a_warning(recwarn):
    from agentgym.training import sft  # noqa: F401
    from agentgym.rollout import env_threads  # noqa: F401
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)
                and "moved to" in str(w.message)]


def test_an_unknown_name_is_a_plain_import_error():
    with pytest.raises(ImportError, match="cannot import name 'no_such_thing'"):
        from agentgym.tracking import no_such_thing  # noqa: F401


@pytest.mark.parametrize("old,name,home", [
    ("agentgym.store", "EPISODES_SCHEMA", "agentgym.store.schema"),
    ("agentgym.store", "CommitManifest", "agentgym.store.manifest"),
    ("agentgym.training", "TrainBatch", "agentgym.training.batch"),
    ("agentgym.training", "PolicyTrainer", "agentgym.training.policy_trainer"),
])
def test_names_of_a_module_split_further_resolve_to_their_new_module(old, name, home):
    with pytest.warns(DeprecationWarning, match=f"import it from {home}"):
        got = getattr(importlib.import_module(old), name)
    assert got is getattr(importlib.import_module(home), name)


def test_paths_handed_to_child_processes_are_the_repository_root():
    """The vLLM server's PYTHONPATH entry must be the folder that holds the
    ``agentgym`` package: one level too deep puts ``agentgym/`` itself on the path, where
    ``agentgym/types.py`` shadows the standard library's ``types`` in the child."""
    from pathlib import Path

    from agentgym.rollout.engines.vllm_server_launch import REPO

    root = Path(__file__).resolve().parents[2]
    assert REPO == root and (REPO / "agentgym" / "__init__.py").is_file()
