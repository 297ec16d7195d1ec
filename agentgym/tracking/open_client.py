"""An ``MlflowClient`` that survives another process creating the same SQLite tracking DB.

Why: the first ``MlflowClient`` on a ``sqlite:///`` URI creates the file and runs MLflow's schema
migrations (alembic). Two processes doing that at once on a fresh file -- the flow and a test's
or viewer's client, or two runs started together against a new DB -- race: the loser's migration
fails with ``sqlite3.OperationalError: duplicate column name: status_details`` (or "table ...
already exists", "database is locked") and the run dies before it starts (tests/flows/test_sft_flow.py
hit it under load; four processes opening one fresh file together reproduce it,
tests/agentgym/test_open_client.py). So ``open_client`` opens a
SQLite store holding an exclusive ``flock`` on the database's folder: this project's processes
migrate one at a time, and each later one finds the schema current. A client outside this project
(``mlflow ui``, a user's notebook) takes no such lock: when one of its migrations races ours, the
winner's migration completes the schema, so ours tries again with a short backoff. Anything else
is re-raised (as is the race's own error once ``attempts`` are spent).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from typing import Any, Iterator

from agentgym.tracking.db_full import db_path

# the SQLite errors of two concurrent schema migrations on one fresh database file
RACE_MARKERS = ("duplicate column name", "already exists", "database is locked",
                "expected to match one row")   # alembic: the other process moved alembic_version on


def is_migration_race(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) is a concurrent migration's SQLite error."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__name__ in ("OperationalError", "CommandError") and any(m in str(e).lower() for m in RACE_MARKERS):
            return True
        e = e.__cause__ or e.__context__
    return False


def open_client(tracking_uri: str, registry_uri: str | None = None, attempts: int = 5,
                first_wait_s: float = 0.5, **kwargs: Any) -> Any:
    """``MlflowClient(tracking_uri, registry_uri)``, retried up to ``attempts`` times (waits of
    ``first_wait_s``, doubling) while another process's schema migration of the same SQLite DB
    makes it fail; other URIs and other errors are not retried."""
    from mlflow.tracking import MlflowClient

    retry = tracking_uri.startswith("sqlite:")
    for attempt in range(attempts):
        try:
            with _migration_lock(tracking_uri):
                return MlflowClient(tracking_uri=tracking_uri, registry_uri=registry_uri, **kwargs)
        except Exception as e:  # noqa: BLE001 -- only the migration race is retried, the rest re-raised
            if not (retry and attempt + 1 < attempts and is_migration_race(e)):
                raise
            time.sleep(first_wait_s * 2 ** attempt)
    raise AssertionError("unreachable")  # pragma: no cover


@contextlib.contextmanager
def _migration_lock(tracking_uri: str) -> Iterator[None]:
    """An exclusive ``flock`` on the folder of a ``sqlite:///`` URI's file while its store opens
    (no lock file left beside the database); nothing for other URIs."""
    db = db_path(tracking_uri)
    if db is None:
        yield
        return
    folder = db.parent
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a filesystem without flock (some NFS mounts): the retry alone guards it
            pass
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
