"""ReplicaReports: one engine deployment's replicas as they report in: when each last did, where it runs (its
Ray node and process), its stats. A replica silent for `stale_after_s` is gone."""

from __future__ import annotations

import time
from typing import Any


class ReplicaReports:
    def __init__(self, stale_after_s: float) -> None:
        self.stale_after_s = stale_after_s
        self._reports: dict[str, tuple[float, dict[str, Any], dict[str, int]]] = {}  # replica -> (when, place, stats)

    def record(self, replica_id: str, place: dict[str, Any], stats: dict[str, int]) -> bool:
        """Record a report; True when the replica was known (reported within `stale_after_s`)."""
        known = replica_id in self._reports
        self._reports[replica_id] = (time.monotonic(), place, stats)
        return known

    def drop_stale(self) -> list[str]:
        """Forget the replicas that fell silent; their ids."""
        now = time.monotonic()
        gone = [replica for replica, (at, _, _) in self._reports.items() if now - at >= self.stale_after_s]
        for replica in gone:
            del self._reports[replica]
        return gone

    def live(self) -> dict[str, dict[str, Any]]:
        """Each replica still reporting: its place and its stats, in one dict."""
        return {replica: {**place, **stats} for replica, (_, place, stats) in self._reports.items()}

    def stats(self) -> list[dict[str, int]]:
        return [stats for _, _, stats in self._reports.values()]
