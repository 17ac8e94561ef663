"""DecisionCosts: the wall-clock cost of a router's latest routing decisions (hashing the prompt's
pages, reading loads, ranking), kept as a bounded sample and summarised in microseconds."""

from __future__ import annotations

import statistics
from collections import deque


class DecisionCosts:
    def __init__(self, keep: int = 4096) -> None:
        self._seconds: deque[float] = deque(maxlen=keep)
        self.decisions = 0

    def add(self, seconds: float) -> None:
        self._seconds.append(seconds)
        self.decisions += 1

    def summary(self) -> dict[str, float]:
        """`decisions` made in all, and the median, p99 and max of the latest ones, in microseconds."""
        if not self._seconds:
            return {"decisions": self.decisions}
        ordered = sorted(self._seconds)
        return {
            "decisions": self.decisions,
            "p50_us": round(statistics.median(ordered) * 1e6, 1),
            "p99_us": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e6, 1),
            "max_us": round(ordered[-1] * 1e6, 1),
        }
