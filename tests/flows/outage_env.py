"""A keyword environment whose backend "goes down" after a number of resets (tests only): every
later reset raises ``InfraError``, so the iteration fails with ``InfraFailure`` before it commits,
like a real outage mid-run. ``AGENTGYM_TEST_OUTAGE_AFTER`` (unset: never) counts resets per process."""

from __future__ import annotations

import os
import threading
from typing import Any

from env_adapters.base import InfraError
from env_adapters.keyword import KeywordEnv

_resets = 0
_lock = threading.Lock()


class OutageKeywordEnv(KeywordEnv):
    name = "outage-keyword"

    def reset(self, task_id: int, seed: int = 0) -> tuple[str, dict[str, Any]]:
        global _resets
        after = os.environ.get("AGENTGYM_TEST_OUTAGE_AFTER")
        with _lock:
            _resets += 1
            down = after is not None and _resets > int(after)
        if down:
            raise InfraError("test outage: the environment server is down")
        return super().reset(task_id, seed)


def reset_counter() -> None:
    global _resets
    with _lock:
        _resets = 0
