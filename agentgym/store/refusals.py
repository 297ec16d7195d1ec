"""An object store (S3) that answers a trajectory write with an error, reported as one clear
``StoreWriteRefused`` naming the bucket, the object, the server's answer and what to do.

Why: s3fs turns the server's answer into a bare ``OSError`` that names neither the bucket nor
the setting. A SeaweedFS bucket over its quota (made read-only by ``s3.bucket.quota.enforce``)
answers every ``PutObject`` and ``CopyObject`` with HTTP 500 ``InternalError`` "We encountered
an internal error, please try again." (observed with SeaweedFS 4.48; botocore retries it 4
times, with backoff, first), which the run reported as ``OSError: [Errno 121] We encountered an internal
error, please try again.``; other servers answer a quota with their own codes (Ceph RGW
``QuotaExceeded``, MinIO ``XMinioAdminBucketQuotaExceeded``) and a denying policy with
``AccessDenied``. Errors without a server answer (a refused connection, a timeout) and the
answers the store handles itself (no such object, a lost exclusive create) pass unchanged.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from typing import Any

from agentgym.infra.diskspace import error_chain

__all__ = ["StoreWriteRefused", "refused_writes"]

_QUOTA = {"QuotaExceeded", "XMinioAdminBucketQuotaExceeded", "XMinioStorageFull", "InsufficientStorage",
          "StorageFull"}
_DENIED = {"AccessDenied", "AllAccessDisabled", "AccountProblem", "InvalidBucketState", "MethodNotAllowed"}


class StoreWriteRefused(OSError):
    """The trajectory store's object store refused a write (quota, permission, server error)."""

    names_the_store = True


def _answer(exc: BaseException) -> dict[str, Any] | None:
    """The S3 server's error response carried by ``exc`` or an error it came from (botocore's
    ``ClientError.response``), or None when no server answered."""
    for e in error_chain(exc):
        resp = getattr(e, "response", None)
        if isinstance(resp, dict) and "Error" in resp:
            return resp
    return None


def _why(code: str, status: int | None) -> tuple[int, str]:
    """(errno, likely cause) of an S3 error code / HTTP status."""
    if code in _QUOTA or status == 507:
        return errno.EDQUOT, "the bucket's quota or the server's space is exhausted"
    if code in _DENIED or status == 403:
        return errno.EACCES, ("the bucket refuses writes: a bucket policy or ACL denies PutObject to "
                              "these credentials, or the bucket was made read-only")
    return errno.EREMOTEIO, ("a SeaweedFS bucket over its quota (made read-only by "
                             "s3.bucket.quota.enforce) answers every write so; otherwise the server "
                             "failed (its log says why)")


@contextlib.contextmanager
def refused_writes(what: str, url: str,
                   state: str = "This iteration is not committed and earlier commits are intact.",
                   ) -> Iterator[None]:
    """Run a write of ``what`` to the object ``url`` (``s3://bucket/key``); if the server
    answers it with an error, raise ``StoreWriteRefused`` naming the bucket, the object, the
    answer, its likely cause and the fix (``state``: what the refusal left), from the original
    error."""
    try:
        yield
    except (FileNotFoundError, FileExistsError, StoreWriteRefused):
        raise  # the store's own business (a missing object, a lost race), or named already
    except Exception as e:
        resp = _answer(e)
        if resp is None:
            raise  # no answer from a server: not a refusal
        err_ = resp.get("Error", {})
        code = str(err_.get("Code", "")) or "?"
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        bucket = err_.get("BucketName") or url.split("://", 1)[-1].split("/", 1)[0]
        number, cause = _why(code, status)
        raise StoreWriteRefused(
            number,
            f"the object store refused to write {what} to {url} (bucket {bucket!r}): HTTP {status} "
            f"{code}: {err_.get('Message', '')} -- likely {cause}. {state} Raise bucket {bucket!r}'s quota or free space in it, or "
            "set store.root to another bucket (store.storage_options for its credentials), then "
            "re-run with the same run id (--run-id) to commit it.") from e
