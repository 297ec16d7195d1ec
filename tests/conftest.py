"""Shared fixtures: a tiny model built locally (no downloads), quiet single-threaded torch."""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# DeepSpeed's accelerator: the CPU one unless a CUDA device is there (tests/gpu run on one)
import torch  # noqa: E402

os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "CRITICAL")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

import tempfile  # noqa: E402

# Prefect keeps its temporary server's SQLite DB under PREFECT_HOME: one per test session.
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="agentgym-prefect-"))
os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")

import pytest  # noqa: E402

# Two cores, and other work may share them: one thread is faster and deterministic here.
torch.set_num_threads(1)


#: The slow lane (``-m slow``): modules whose tests start processes, servers, browsers or JVMs
#: (Prefect flows, DeepSpeed groups, kill-and-resume, Chromium, ScienceWorld), and the test ids
#: of the heavy environments in the shared parametrized suites. The rest is the fast lane,
#: ``pytest -m "not slow"`` (README). Chosen from ``--durations`` of the full suite.
SLOW_MODULES = (
    "tests/flows/", "tests/reliability/", "tests/cluster/",
    "tests/agentgym/test_sft.py", "tests/agentgym/test_inspect.py", "tests/agentgym/test_patches.py",
    "tests/env_adapters/test_miniwob.py", "tests/env_adapters/test_sciworld.py",
    "tests/env_adapters/test_checker.py", "tests/test_no_prefect_in_library.py", "tests/engines/",
)
#: modules kept in the fast lane although they sit under a slow folder (no process, no server)
FAST_MODULES = ("tests/flows/test_runtime_sessions.py", "tests/flows/test_prefect_yaml.py",
                "tests/flows/test_params.py", "tests/flows/test_links.py")
SLOW_PARAMS = ("[sciworld]", "[miniwob]", "[mcp]", "[sciworld-", "[miniwob-", "[mcp-", "-sciworld]", "-miniwob]",
               "-mcp]")


#: modules that start Ray clusters (the session's two loopback nodes, or a command's embedded one):
#: under pytest-xdist they run one after another on one worker (``ModuleScheduling``)
RAY_MODULES = ("tests/cluster/",)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which may be absent
def pytest_xdist_make_scheduler(config, log):
    """`pytest -n 2` (scripts/test.sh) hands out whole modules, so a module's fixtures (servers,
    Prefect deployments) start once, and every Ray module to one worker, so two Ray clusters never
    run at once. (pytest-xdist's own ``--dist loadgroup`` renames node ids, which pytest 9 no longer
    allows, so its groups would silently be single tests.) Another ``--dist`` mode given on the
    command line is left to pytest-xdist."""
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::")[0]
            return "ray" if path.startswith(RAY_MODULES) else path

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        path = item.nodeid.split("::")[0]
        if (path.startswith(SLOW_MODULES) and not path.startswith(FAST_MODULES)) \
                or any(p in item.nodeid for p in SLOW_PARAMS):
            item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_path(model_cache):
    from agentgym.models.folders import tiny_model_path

    return tiny_model_path(model_cache, template="chatml")


@pytest.fixture(scope="session")
def tiny_llama3_path(model_cache):
    from agentgym.models.folders import tiny_model_path

    return tiny_model_path(model_cache, template="llama3")


@pytest.fixture(scope="module")
def s3_server():
    """A SeaweedFS `weed mini` (tests/seaweed.py); skips the test where it cannot run."""
    from seaweed import SeaweedUnavailable, seaweed  # tests/ is on sys.path (rootdir conftest)

    try:
        cm = seaweed()
        server = cm.__enter__()
    except SeaweedUnavailable as e:
        pytest.skip(str(e))
    try:
        yield server
    finally:
        cm.__exit__(None, None, None)
