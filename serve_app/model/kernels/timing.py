"""Timing kernel choices at start: each candidate's fastest call, the candidates interleaved, so that a host's
drift during the timing falls on all of them alike."""

from __future__ import annotations

import time
from collections.abc import Callable


def fastest(products: dict[str, Callable[[], object]], calls: int) -> dict[str, float]:
    """Seconds of each product's fastest of `calls` calls, after one round that warms them up."""
    best = dict.fromkeys(products, float("inf"))
    for _ in range(calls + 1):
        for name, product in products.items():
            started = time.perf_counter()
            product()
            best[name] = min(best[name], time.perf_counter() - started)
    return best
