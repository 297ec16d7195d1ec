"""Commit manifests: what a committed iteration of one table holds (files, rows, digests), and a
shard staged under its hidden name before it is published."""

from __future__ import annotations

import datetime as _dt
import hashlib
import logging
from dataclasses import asdict, dataclass, field
from typing import Any


from agentgym.store.schema import SCHEMA_VERSION, StoreError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagedShard:
    """A shard written under its hidden name, not yet published or committed."""

    tmp: str  # fs path of the hidden file
    rel: str  # its published path, relative to the run's folder
    sha256: str
    rows: int
    nbytes: int


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def combined_digest(sha256: dict[str, str]) -> str:
    """One digest over the (path, sha256) pairs of a commit, independent of order."""
    lines = "".join(f"{p}\t{h}\n" for p, h in sorted(sha256.items()))
    return sha256_hex(lines.encode())


def utc_now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


@dataclass
class CommitManifest:
    """What a commit file records. ``files`` are relative to ``{root}/{run_id}``."""

    table: str
    stage: int
    iteration: int
    rows: int
    files: list[str]
    digest: str  # sha256 over the sorted "path\tsha256" lines of ``sha256``
    sha256: dict[str, str]  # relative path -> sha256 of the file's bytes
    writer: dict[str, Any]  # {"host", "pid"}
    created_at: str  # ISO 8601, UTC
    run_id: str = ""
    schema_version: int = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CommitManifest:
        try:
            return cls(
                table=str(d["table"]),
                stage=int(d["stage"]),
                iteration=int(d["iteration"]),
                rows=int(d["rows"]),
                files=[str(f) for f in d["files"]],
                digest=str(d["digest"]),
                sha256={str(k): str(v) for k, v in dict(d["sha256"]).items()},
                writer=dict(d["writer"]) if isinstance(d["writer"], dict) else {"id": d["writer"]},
                created_at=str(d["created_at"]),
                run_id=str(d.get("run_id", "")),
                schema_version=int(d.get("schema_version", SCHEMA_VERSION)),
                extra=dict(d.get("extra") or {}),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise StoreError(f"malformed commit manifest: {type(e).__name__}: {e}") from e

    def check(self) -> None:
        """Internal consistency: every listed file has a hash and the digest matches them."""
        if sorted(self.files) != sorted(self.sha256):
            raise StoreError(
                f"manifest {self.table} {self.stage}-{self.iteration}: files and sha256 disagree"
            )
        if combined_digest(self.sha256) != self.digest:
            raise StoreError(
                f"manifest {self.table} {self.stage}-{self.iteration}: combined digest mismatch"
            )
