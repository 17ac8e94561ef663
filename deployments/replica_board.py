"""ReplicaBoard: where every engine replica reports its stats and the pages its prefix cache holds, kept
apart per engine deployment (one per model). The ingress sums the stats and reads each model's readiness
here; each ingress's request router follows its deployment's page directory (`page_changes`, which waits
for news rather than being asked again and again), so all of them route on the same view, and says what
its decisions cost (`report_routing`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ray import serve

from serve_app.routing.page_directory import PageChanges
from serve_app.routing.page_news import PageNews
from serve_app.routing.replica_reports import ReplicaReports
from serve_app.wire.page_events import PageEventBatch

# A replica that has not reported for this long is gone.
STALE_AFTER_S = 3.0
# The request routers' reports of their decisions' cost are kept this long after their last one.
ROUTER_REPORTS_KEPT_S = 600.0
NAME = "ReplicaBoard"
# Calls at once: every router's waiting `page_changes`, the replicas' reports, the ingresses' reads.
MAX_ONGOING_CALLS = 1024


@dataclass
class _DeploymentBoard:
    """One engine deployment's live replicas, its model's info and its page news."""

    replicas: ReplicaReports = field(default_factory=lambda: ReplicaReports(STALE_AFTER_S))
    pages: PageNews = field(default_factory=PageNews)
    model_info: Any = None

    def drop_stale(self) -> None:
        gone = self.replicas.drop_stale()
        if gone:
            self.pages.forget(gone)


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
        board.drop_stale()
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
        known = board.replicas.record(replica_id, place, stats)
        board.model_info = model_info
        if not known and pages.snapshot is None:
            return True
        board.pages.publish(replica_id, pages, page_size)
        return False

    def summed(self) -> dict[str, int]:
        """Every engine replica's stats (of every model), summed."""
        total: dict[str, int] = {"replicas": 0}
        for deployment in list(self._deployments):
            for stats in self._of(deployment).replicas.stats():
                total["replicas"] += 1
                for key, value in stats.items():
                    total[key] = total.get(key, 0) + value
        return total

    def per_replica(self) -> dict[str, dict[str, Any]]:
        """Each live replica's stats, its model, and where it runs (`node_id`, `pid`)."""
        replicas = {}
        for deployment in list(self._deployments):
            board = self._of(deployment)
            model = board.model_info.id if board.model_info is not None else None
            for replica_id, report in board.replicas.live().items():
                replicas[replica_id] = {"model": model, **report}
        return replicas

    def status(self, deployment: str) -> tuple[bool, Any]:
        """(an engine replica of `deployment` is up, its model's info)."""
        board = self._of(deployment)
        return bool(board.replicas.stats()), board.model_info

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
        with nothing new yet, first up to `wait_s` for something to happen (a replica falling silent meanwhile
        is news too)."""
        board = self._of(deployment)
        changes = await board.pages.changes(since, wait_s)
        if changes.seq == since:
            board.drop_stale()
            changes = board.pages.directory.changes(since)
        return changes
