"""ReplicaBoard: where every engine replica reports its stats and the pages its prefix cache holds, kept
apart per engine deployment (one per model). The ingress sums the stats and reads each model's readiness
here; each ingress's request router follows its deployment's page directory (`page_changes`, which waits
for news rather than being asked again and again), so all of them route on the same view, and says what
its decisions cost (`report_routing`)."""

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


class _DeploymentBoard:
    """One engine deployment's live replicas, its model's info and its page directory."""

    def __init__(self) -> None:
        self.reports: dict[str, tuple[float, dict[str, Any], dict[str, int]]] = {}  # replica -> (when, place, stats)
        self.model_info: Any = None
        self.pages = PageDirectory()
        self.news = asyncio.Event()  # set (and replaced) when the page directory changes
        self._announced = 0

    def live(self) -> list[dict[str, int]]:
        now = time.monotonic()
        for replica_id in [k for k, (at, _, _) in self.reports.items() if now - at >= STALE_AFTER_S]:
            del self.reports[replica_id]
            self.pages.forget(replica_id)
            self.tell_waiting_routers()
        return [stats for _, _, stats in self.reports.values()]

    def tell_waiting_routers(self) -> None:
        if self.pages.seq != self._announced:
            self._announced = self.pages.seq
            self.news.set()
            self.news = asyncio.Event()


@serve.deployment(
    name=NAME,
    num_replicas=1,
    max_ongoing_requests=MAX_ONGOING_CALLS,
    ray_actor_options={"num_cpus": 0},
    logging_config={"enable_access_log": False},
)
class ReplicaBoard:
    def __init__(self) -> None:
        self._deployments: dict[str, _DeploymentBoard] = {}
        self._routers: dict[str, tuple[float, dict[str, Any]]] = {}  # router -> (when, its report)

    def _of(self, deployment: str) -> _DeploymentBoard:
        board = self._deployments.get(deployment)
        if board is None:
            board = self._deployments[deployment] = _DeploymentBoard()
        return board

    async def report(
        self,
        deployment: str,
        replica_id: str,
        place: dict[str, Any],
        stats: dict[str, int],
        model_info: Any,
        pages: PageEventBatch,
        page_size: int,
    ) -> bool:
        """Record a replica's report (`place`: its Ray node and process id); True when the board needs a
        snapshot of its pages (it has forgotten a replica that fell silent and came back)."""
        board = self._of(deployment)
        known = replica_id in board.reports
        board.reports[replica_id] = (time.monotonic(), place, stats)
        board.model_info = model_info
        if not known and pages.snapshot is None:
            return True
        board.pages.publish(replica_id, pages, page_size)
        board.tell_waiting_routers()
        return False

    def summed(self) -> dict[str, int]:
        """Every engine replica's stats (of every model), summed."""
        total: dict[str, int] = {"replicas": 0}
        for board in self._deployments.values():
            for stats in board.live():
                total["replicas"] += 1
                for key, value in stats.items():
                    total[key] = total.get(key, 0) + value
        return total

    def per_replica(self) -> dict[str, dict[str, Any]]:
        """Each live replica's stats, its model, and where it runs (`node_id`, `pid`)."""
        replicas = {}
        for board in self._deployments.values():
            board.live()
            model = board.model_info.id if board.model_info is not None else None
            for replica_id, (_, place, stats) in board.reports.items():
                replicas[replica_id] = {"model": model, **place, **stats}
        return replicas

    def status(self, deployment: str) -> tuple[bool, Any]:
        """(an engine replica of `deployment` is up, its model's info)."""
        board = self._of(deployment)
        return bool(board.live()), board.model_info

    def report_routing(self, router: str, costs: dict[str, Any]) -> None:
        """A request router's report: its decision count and costs (`DecisionCosts.summary`), what it follows,
        and its `recent` decisions."""
        self._routers[router] = (time.monotonic(), costs)

    def routing(self) -> dict[str, dict[str, Any]]:
        """Each request router's latest report, by router (its deployment, process and instance)."""
        now = time.monotonic()
        for router in [k for k, (at, _) in self._routers.items() if now - at >= ROUTER_REPORTS_KEPT_S]:
            del self._routers[router]
        return {router: costs for router, (_, costs) in self._routers.items()}

    async def page_changes(self, deployment: str, since: int, wait_s: float = 0.0) -> PageChanges:
        """What `deployment`'s prefix caches gained and lost after `since` (see `PageDirectory.changes`);
        with nothing new yet, first up to `wait_s` for something to happen."""
        board = self._of(deployment)
        board.live()
        if since == board.pages.seq and wait_s > 0:
            try:
                await asyncio.wait_for(board.news.wait(), wait_s)
            except TimeoutError:
                board.live()
        return board.pages.changes(since)
