"""``agentgym.infra.heap.release_freed_heap`` gives freed-but-kept C heap back to the OS: the fix for
the RSS growth per vLLM CPU weight rebuild (docs/reliability.md, "Soak")."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentgym.infra.heap import _malloc_trim, release_freed_heap


def _rss_anon_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    pytest.skip("no RssAnon in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").exists() or not _malloc_trim(),
                    reason="needs Linux /proc and glibc's malloc_trim")
def test_freed_heap_kept_by_malloc_is_given_back():
    # 1,500 written blocks of 100 KB (under glibc's 128 KiB mmap threshold: from the heap), then
    # all but the last freed: the last one pins the heap's top, so free() cannot shrink it.
    block = bytes(range(256)) * 400
    held = [bytearray(block) for _ in range(1500)]
    pinned = held[-1]
    base = _rss_anon_mib()
    del held[:-1]
    kept = _rss_anon_mib()
    assert base - kept < 50, f"free() already gave the heap back ({base:.0f} -> {kept:.0f} MiB): nothing to test"
    assert release_freed_heap() is True
    after = _rss_anon_mib()
    assert kept - after > 100, f"RssAnon {kept:.0f} -> {after:.0f} MiB after malloc_trim(0)"
    del pinned
