"""Waiting for an engine to be idle with every KV page back (benchmarks and tests share it)."""

from __future__ import annotations

import time
from collections.abc import Callable

Stats = dict[str, int]


def is_idle(stats: Stats) -> bool:
    """Nothing running or waiting, every page free (cached pages nobody holds count as free), and every page
    copied out for the KV tiers written."""
    return (stats["active_tasks"] == 0 and stats["waiting_queue"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]
            and stats.get("kv_tier_writes_queued_bytes", 0) == 0)


def wait_idle(read_stats: Callable[[], Stats], timeout: float = 30.0, interval: float = 0.05) -> Stats:
    """Poll `read_stats` until `is_idle`; return those stats, or raise TimeoutError with the last ones."""
    deadline = time.monotonic() + timeout
    while True:
        stats = read_stats()
        if is_idle(stats):
            return stats
        if time.monotonic() > deadline:
            raise TimeoutError(f"not idle with every page back after {timeout} s: {stats}")
        time.sleep(interval)


def http_stats(url: str) -> Callable[[], Stats]:
    """A reader of a server's `/stats` (the engine replicas' stats, summed)."""
    import httpx

    return lambda: httpx.get(f"{url}/stats", timeout=10).json()
