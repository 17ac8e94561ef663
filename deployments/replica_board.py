"""ReplicaBoard: where every engine replica reports its stats and the pages its prefix cache holds.
The ingress sums the stats and reads readiness here; each ingress's request router follows the
page directory (`page_changes`, which waits for news rather than being asked again and again), so
all of them route on the same view, and says what its decisions cost (`report_routing`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ray import serve

from serve_app.kv.page_events import PageEventBatch
from serve_app.routing.page_directory import PageChanges, PageDirectory

# A replica that has not reported for this long is gone.
STALE_AFTER_S = 3.0
# The request routers' reports of their decisions' cost are kept this long after their last one.
ROUTER_REPORTS_KEPT_S = 600.0
NAME = "ReplicaBoard"
# Calls at once: every router's waiting `page_changes`, the replicas' reports, the ingresses' reads.
MAX_ONGOING_CALLS = 1024


@serve.deployment(
    name=NAME,
    num_replicas=1,
    max_ongoing_requests=MAX_ONGOING_CALLS,
    ray_actor_options={"num_cpus": 0},
    logging_config={"enable_access_log": False},
)
class ReplicaBoard:
    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, dict[str, Any], dict[str, int]]] = {}  # replica -> (when, place, stats)
        self._model_info: Any = None
        self._pages = PageDirectory()
        self._routers: dict[str, tuple[float, dict[str, float]]] = {}  # router -> (when, decision costs)
        self._news = asyncio.Event()  # set (and replaced) when the page directory changes
        self._announced = 0

    async def report(
        self,
        replica_id: str,
        place: dict[str, Any],
        stats: dict[str, int],
        model_info: Any,
        pages: PageEventBatch,
        page_size: int,
    ) -> bool:
        """Record a replica's report (`place`: its Ray node and process id); True when the board needs a
        snapshot of its pages (it has forgotten a replica that fell silent and came back)."""
        known = replica_id in self._reports
        self._reports[replica_id] = (time.monotonic(), place, stats)
        self._model_info = model_info
        if not known and pages.snapshot is None:
            return True
        self._pages.publish(replica_id, pages, page_size)
        self._tell_waiting_routers()
        return False

    def _live(self) -> list[dict[str, int]]:
        now = time.monotonic()
        for replica_id in [k for k, (at, _, _) in self._reports.items() if now - at >= STALE_AFTER_S]:
            del self._reports[replica_id]
            self._pages.forget(replica_id)
            self._tell_waiting_routers()
        return [stats for _, _, stats in self._reports.values()]

    def summed(self) -> dict[str, int]:
        live = self._live()
        total: dict[str, int] = {"replicas": len(live)}
        for stats in live:
            for key, value in stats.items():
                total[key] = total.get(key, 0) + value
        return total

    def per_replica(self) -> dict[str, dict[str, Any]]:
        """Each live replica's stats, and where it runs (`node_id`, `pid`)."""
        self._live()
        return {replica_id: {**place, **stats} for replica_id, (_, place, stats) in self._reports.items()}

    def status(self) -> tuple[bool, Any]:
        """(an engine replica is up, the served model's info)."""
        return bool(self._live()), self._model_info

    def report_routing(self, router: str, costs: dict[str, float]) -> None:
        """A request router's decision count and costs (`DecisionCosts.summary`)."""
        self._routers[router] = (time.monotonic(), costs)

    def routing(self) -> dict[str, dict[str, float]]:
        """Each request router's latest report, by router (its application, process and instance)."""
        now = time.monotonic()
        for router in [k for k, (at, _) in self._routers.items() if now - at >= ROUTER_REPORTS_KEPT_S]:
            del self._routers[router]
        return {router: costs for router, (_, costs) in self._routers.items()}

    async def page_changes(self, since: int, wait_s: float = 0.0) -> PageChanges:
        """What the replicas' prefix caches gained and lost after `since` (see `PageDirectory.changes`);
        with nothing new yet, first up to `wait_s` for something to happen."""
        self._live()
        if since == self._pages.seq and wait_s > 0:
            try:
                await asyncio.wait_for(self._news.wait(), wait_s)
            except TimeoutError:
                self._live()
        return self._pages.changes(since)

    def _tell_waiting_routers(self) -> None:
        if self._pages.seq != self._announced:
            self._announced = self._pages.seq
            self._news.set()
            self._news = asyncio.Event()
