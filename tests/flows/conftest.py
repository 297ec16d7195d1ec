"""Fixtures of the flow tests: a local Prefect server + process worker (deployments/local.sh)."""

import pytest

from local_stack import LocalStack  # tests/flows is on sys.path (rootdir-less test dirs)


@pytest.fixture(scope="session")
def local_stack(tmp_path_factory, tiny_path):
    """Started once per test session and stopped at its end; ``tiny_path`` first builds
    the tiny model into the shared cache, so flow runs find it instead of racing to build it."""
    stack = LocalStack(tmp_path_factory.mktemp("local-stack"))
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()
