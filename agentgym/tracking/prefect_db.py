"""A flow that failed because the disk under Prefect's own database is full, named as such.

Why: `agentgym train` runs its flow against a temporary Prefect server whose SQLite database
lives in ``PREFECT_HOME`` (``prefect.db``). When that disk fills, the server answers each write
with HTTP 500 ``{'exception_message': 'Internal Server Error'}``; SQLite's "database or disk is
full" stays inside the server. The run then ended with ``PrefectHTTPStatusError: Server error
'500 Internal Server Error' for url 'http://127.0.0.1:8962/api/flow_runs/<id>/set_state'``,
which names neither the disk, the database nor the setting that moves it (observed on a
filled tmpfs; ``tests/reliability/test_prefect_disk_full.py``).

``prefect_disk_error(exc)`` turns such a failure into ``OSError(ENOSPC)`` naming the database
file, how much space is left, and the settings to fix. It only does so when this process knows
where the database is (no ``PREFECT_API_URL``, or that of the temporary server `agentgym`
started: the server whose database URL this process's settings give) and that disk is (nearly) full; any other error is left alone. A
server elsewhere (``PREFECT_API_URL``) keeps its database out of this process's sight.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from agentgym.infra.diskspace import NEARLY_FULL_BYTES, error_chain, free_bytes, is_out_of_space, names_the_disk

__all__ = ["TEMPORARY_SERVER_ENV", "prefect_database", "prefect_disk_error"]

#: the API URL of the temporary Prefect server `agentgym` started for this command (agentgym_cli/
#: common.py): a server of this process, on this process's database, though PREFECT_API_URL is set
TEMPORARY_SERVER_ENV = "AGENTGYM_PREFECT_TEMPORARY_API"

FIX = ("free space on that disk, or move Prefect's database: PREFECT_HOME (the folder holding "
       "prefect.db) or PREFECT_API_DATABASE_CONNECTION_URL (PREFECT_SERVER_DATABASE_CONNECTION_URL)")


def prefect_database() -> Path | None:
    """The SQLite file of the temporary Prefect server this process starts; None when a server
    elsewhere is used (``PREFECT_API_URL``, other than ``TEMPORARY_SERVER_ENV``'s) or the database
    is not a local SQLite file."""
    try:
        from prefect.settings import get_current_settings
        from sqlalchemy.engine import make_url

        settings = get_current_settings()
        if settings.api.url and settings.api.url != os.environ.get(TEMPORARY_SERVER_ENV):
            return None
        secret = settings.server.database.connection_url
        url = make_url(secret.get_secret_value() if secret is not None else "")
    except Exception:  # noqa: BLE001 - no Prefect settings, no database to name
        return None
    if not url.drivername.startswith("sqlite") or not url.database or "memory" in url.database:
        return None
    return Path(url.database).expanduser()


def _from_prefect_api(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it came from) is a failed call to the Prefect API or its
    server: a 5xx answer, or the server (or a client of it) giving up."""
    for e in error_chain(exc):
        status = getattr(getattr(e, "response", None), "status_code", None)
        module = type(e).__module__ or ""
        if module.startswith(("prefect", "httpx", "httpcore")) and (status is None or status >= 500):
            return True
    return False


def prefect_disk_error(exc: BaseException) -> OSError | None:
    """``OSError(ENOSPC)`` naming Prefect's database if ``exc`` is a Prefect API failure while
    the disk under that database is full; else None."""
    if getattr(exc, "names_the_disk", False) or not _from_prefect_api(exc):
        return None  # ours (already named), or not Prefect's
    db = prefect_database()
    if db is None:
        return None
    free = free_bytes(db)
    if not (is_out_of_space(exc) or (free is not None and free < NEARLY_FULL_BYTES)):
        return None  # the disk has room: a 500 for another reason
    status = getattr(getattr(exc, "response", None), "status_code", None)
    answered = f"; the Prefect API answered HTTP {status}" if status else ""
    left = f"{free:,} bytes free there" if free is not None else "free space unknown"
    err = OSError(errno.ENOSPC, f"No space left on device: the Prefect database {db} could not be "
                                f"written ({left}{answered}); {FIX}")
    err.__cause__ = exc
    return names_the_disk(err)
