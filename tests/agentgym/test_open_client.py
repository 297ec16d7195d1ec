"""agentgym/tracking/open_client.py: a client opened while another process migrates the same
fresh SQLite tracking DB is retried, not a dead run; other errors are not retried."""
import sqlite3
import subprocess
import sys
import time

import pytest
from sqlalchemy.exc import OperationalError

import mlflow.tracking
from agentgym.tracking import open_client as oc


def _race(msg: str = "duplicate column name: status_details") -> OperationalError:
    return OperationalError("ALTER TABLE jobs ADD COLUMN status_details JSON", {}, sqlite3.OperationalError(msg))


class _Flaky:
    """MlflowClient stand-in failing its first ``fails`` constructions with ``error``."""
    calls = 0

    def __init__(self, fails: int, error: Exception):
        self.fails, self.error = fails, error

    def __call__(self, **kwargs):
        type(self).calls += 1
        if type(self).calls <= self.fails:
            raise self.error
        return ("client", kwargs)


@pytest.fixture
def flaky(monkeypatch):
    def install(fails: int, error: Exception) -> type[_Flaky]:
        _Flaky.calls = 0
        monkeypatch.setattr(mlflow.tracking, "MlflowClient", _Flaky(fails, error))
        return _Flaky
    return install


def test_a_migration_race_is_retried_until_the_schema_is_there(flaky):
    counter = flaky(2, _race())
    got = oc.open_client("sqlite:///x.db", first_wait_s=0.001)
    assert got == ("client", {"tracking_uri": "sqlite:///x.db", "registry_uri": None}) and counter.calls == 3
    # the other markers of the same race, wrapped as MLflow wraps them
    for msg in ("table experiments already exists", "database is locked"):
        wrapped = RuntimeError("store init failed")
        wrapped.__cause__ = _race(msg)
        counter = flaky(1, wrapped)
        assert oc.open_client("sqlite:///x.db", first_wait_s=0.001)[0] == "client" and counter.calls == 2


def test_other_errors_and_other_stores_are_not_retried(flaky):
    counter = flaky(1, _race("no such table: runs"))  # a broken DB, not a race
    with pytest.raises(OperationalError, match="no such table"):
        oc.open_client("sqlite:///x.db", first_wait_s=0.001)
    assert counter.calls == 1
    counter = flaky(1, _race())  # a server store: its migrations are the server's business
    with pytest.raises(OperationalError):
        oc.open_client("http://127.0.0.1:5000", first_wait_s=0.001)
    assert counter.calls == 1
    counter = flaky(10, _race())  # attempts spent: the race's own error
    with pytest.raises(OperationalError, match="duplicate column"):
        oc.open_client("sqlite:///x.db", attempts=3, first_wait_s=0.001)
    assert counter.calls == 3


CHILD = """
import sys, time
start = float(sys.argv[2])
while time.time() < start:
    time.sleep(0.001)
from agentgym.tracking.open_client import open_client
c = open_client(sys.argv[1])
c.search_experiments()
"""


@pytest.mark.slow
def test_processes_opening_one_fresh_db_together_all_start(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    start = time.time() + 8  # after every child has imported mlflow: they migrate at once
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, uri, str(start)], stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    errs = [p.communicate(timeout=180)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(errs)
    assert mlflow.tracking.MlflowClient(tracking_uri=uri).search_experiments()  # the Default experiment
