"""A full MLflow tracking database, reported as ENOSPC naming ``tracking.tracking_uri``.

Why: when the disk under a SQLite tracking DB is full, every MLflow write (a metric, a tag, a
run) fails with ``MlflowException('(raised as a result of Query-invoked autoflush ...)
(sqlite3.OperationalError) database or disk is full [SQL: INSERT INTO metrics ...]')``: an
SQLAlchemy message with the SQL and its parameters, naming neither the file nor the setting
(tests/reliability reproduces it on a filled tmpfs). SQLite rolls the failed transaction back, so the DB stays readable
and consistent, and a re-run with space resumes; only the message needed fixing.

``guarded(client, tracking_uri)`` wraps an ``MlflowClient`` so that such a failure of any of its
calls raises ``OSError(ENOSPC, "No space left on device: the MLflow tracking database <path>
...; ... tracking.tracking_uri ...")`` from the original. Every other error passes unchanged (an
artifact upload that fills the artifact store is named by ``Tracker._upload``, not here).
"""

from __future__ import annotations

import errno
import functools
from pathlib import Path
from typing import Any

from agentgym.infra.diskspace import NEARLY_FULL_BYTES, error_chain, free_bytes, names_the_disk

# SQLITE_FULL's text; SQLITE_IOERR's where the disk is (nearly) full (a journal write refused)
_FULL = "database or disk is full"
_IOERR = "disk i/o error"


def db_path(tracking_uri: str) -> Path | None:
    """The file of a ``sqlite:///`` tracking URI (None for a server or another database)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    return Path(tracking_uri[len("sqlite:///"):]).expanduser().absolute()


def _db_full(exc: BaseException, path: Path | None) -> bool:
    for e in error_chain(exc):
        text = str(e).lower()
        if _FULL in text:
            return True
        if _IOERR in text and path is not None:
            free = free_bytes(path)
            if free is not None and free < NEARLY_FULL_BYTES:
                return True
    return False


def full_db_error(tracking_uri: str) -> OSError:
    path = db_path(tracking_uri)
    where = f"the MLflow tracking database {path}" if path else f"the MLflow tracking store {tracking_uri}"
    free = free_bytes(path) if path else None
    left = f"{free:,} bytes free there" if free is not None else "free space unknown"
    err = OSError(errno.ENOSPC, f"No space left on device: {where} could not be written ({left}); free "
                                f"space on its disk, or point tracking.tracking_uri at a disk with room, then "
                                "re-run with the same run_id: it resumes (the database was left as it was "
                                "before the failed write)")
    return names_the_disk(err)  # an outer disk_errors keeps it as it is


class GuardedClient:
    """An ``MlflowClient`` whose calls report a full tracking database clearly (module doc)."""

    def __init__(self, client: Any, tracking_uri: str):
        self._client, self._uri, self._path = client, tracking_uri, db_path(tracking_uri)

    @property
    def wrapped(self) -> Any:
        """The plain ``MlflowClient``."""
        return self._client

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            except Exception as e:
                if _db_full(e, self._path):
                    raise full_db_error(self._uri) from e
                raise

        return call


def guarded(client: Any, tracking_uri: str) -> GuardedClient:
    return GuardedClient(client, tracking_uri)
