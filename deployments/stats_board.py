"""StatsBoard: where every engine replica reports its stats, so the ingress can sum them and see readiness."""

from __future__ import annotations

import time
from typing import Any

from ray import serve

# A replica that has not reported for this long is gone.
STALE_AFTER_S = 3.0


@serve.deployment(
    name="StatsBoard",
    num_replicas=1,
    ray_actor_options={"num_cpus": 0},
    logging_config={"enable_access_log": False},
)
class StatsBoard:
    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, dict[str, int]]] = {}
        self._model_info: Any = None

    def report(self, replica_id: str, stats: dict[str, int], model_info: Any) -> None:
        self._reports[replica_id] = (time.monotonic(), stats)
        self._model_info = model_info

    def _live(self) -> list[dict[str, int]]:
        now = time.monotonic()
        self._reports = {k: v for k, v in self._reports.items() if now - v[0] < STALE_AFTER_S}
        return [stats for _, stats in self._reports.values()]

    def summed(self) -> dict[str, int]:
        live = self._live()
        total: dict[str, int] = {"replicas": len(live)}
        for stats in live:
            for key, value in stats.items():
                total[key] = total.get(key, 0) + value
        return total

    def status(self) -> tuple[bool, Any]:
        """(an engine replica is up, the served model's info)."""
        return bool(self._live()), self._model_info
