"""PrefixAwareRouter: Serve's request router for each model's engine deployment, chosen in
serve_config.yaml (`request_router_config`). It sends a request to the replica holding the longest run
of its prompt's pages (the prefix cache's own chained hashes, with the tenant's cache salt and the
LoRA adapter), else to one it has sent the request's adapter to, unless queues are imbalanced; KV
calls (`LookupKV`, `RetrieveKV`, `StoreKV`) go where their prefix is.

It learns what each replica holds by following its deployment's page directory on the ReplicaBoard in
the background while requests come (every ingress's router reads the same view; each ask waits at the
board for news, at most every `refresh_s`; a router idle for `idle_after_s` stops asking, and
catches up on its next request) and by noting where it has just sent a prompt. It times its own
decisions and tells the board (`/stats/routing`), with how often its follower has started and how
many pages it knows of.

Nothing here blocks or waits on the router's event loop, in either of Serve's modes. A routing
decision never waits on the board: it ranks with what is known. The board's handle routes on the
loop that runs this router (`_run_router_in_separate_loop=False`): a handle that routes on Serve's
shared router loop would, on its first call from a task on that same loop, wait for that loop to
run its set-up, and every routing decision in the process would hang (Serve's default mode).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from deployments.replica_board import NAME as BOARD
from serve_app.kv.prefix_cache import PageHash
from serve_app.metrics import tracing
from serve_app.routing.costs import DecisionCosts
from serve_app.routing.decision import PrefixRouting
from serve_app.routing.policy import RoutingPolicy
from serve_app.wire.calls import LookupKV, RetrieveKV, StoreKV
from serve_app.wire.requests import EncodedRequest

logger = logging.getLogger(__name__)

# How long one ask for the page directory's changes waits for news.
WAIT_FOR_CHANGES_S = 1.0
# How often a router tells the board what its decisions cost (`/stats/routing`).
REPORT_COSTS_S = 2.0
# The latest decisions a router reports (where each request went, and how much of its prompt was cached there).
RECENT_DECISIONS = 8
# Page hashes kept for requests between their first ranking and their routing.
PENDING_HASHES = 4096


class PrefixAwareRouter(RequestRouter):
    def initialize_state(
        self,
        balance_abs_threshold: int = 4,
        balance_rel_threshold: float = 1.5,
        min_match_ratio: float = 0.5,
        refresh_s: float = 0.05,
        idle_after_s: float = 30.0,
    ) -> None:
        self._routing = PrefixRouting(RoutingPolicy(balance_abs_threshold, balance_rel_threshold, min_match_ratio))
        self._refresh_s = refresh_s
        self._idle_after_s = idle_after_s
        self._board: DeploymentHandle | None = None
        self._follower: asyncio.Task | None = None
        self._follower_starts = 0
        self._last_request = 0.0
        self._hashes: OrderedDict[str, list[PageHash]] = OrderedDict()  # by internal request id, until routed
        self._costs = DecisionCosts()
        self._recent: deque[dict[str, Any]] = deque(maxlen=RECENT_DECISIONS)
        self._reported: dict[str, Any] = {}
        self._deployment = self._deployment_id.name
        self._name = f"{self.app_name}:{self._deployment}:{os.getpid()}:{id(self):x}"

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        self._follow_the_board()
        started = time.perf_counter()
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # full replicas: wait, do not spin
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        loads = {key: self.replica_queue_len_cache.get(replica.replica_id) or 0 for key, replica in by_id.items()}
        adapter = _adapter_of(pending_request.args) if pending_request is not None else None
        ranked = self._routing.rank(self._page_hashes(pending_request), by_id, loads, adapter)
        seconds = time.perf_counter() - started
        self._costs.add(seconds)
        _trace(pending_request, ranked, seconds)
        return [[by_id[key] for key in group] for group in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        hashes = self._hashes.pop(pending_request.metadata.internal_request_id, None)
        if hashes is None:
            hashes = self._page_hashes(pending_request)
        replica = replica_id.unique_id
        if _prompt_of(pending_request.args) is not None:  # a request, not a call such as the model list
            cached = self._routing.index.matched_pages(hashes, [replica]).get(replica, 0) if hashes else 0
            self._recent.append({"at": round(time.time(), 3), "replica": replica, "cached_pages": cached, "pages": len(hashes)})
        self._routing.routed(replica, hashes, _adapter_of(pending_request.args))

    def _page_hashes(self, pending_request: PendingRequest | None) -> list[PageHash]:
        """The chained hashes of the request's whole prompt pages, as the engine's prefix cache makes them:
        made once per request (a request that waits for a replica is ranked again on every try)."""
        if pending_request is None:
            return []
        request_id = pending_request.metadata.internal_request_id
        hashes = self._hashes.get(request_id)
        if hashes is None:
            key = _prompt_of(pending_request.args)
            hashes = self._routing.hashes(*key) if key is not None else []
            if hashes:  # none before the directory has said what a page is: ask again next time
                self._hashes[request_id] = hashes
                while len(self._hashes) > PENDING_HASHES:  # requests cancelled before they were routed
                    self._hashes.popitem(last=False)
        return hashes

    def _follow_the_board(self) -> None:
        self._last_request = time.monotonic()
        if self._follower is None or self._follower.done():
            self._follower_starts += 1
            self._follower = asyncio.get_running_loop().create_task(self._follow())

    def _board_handle(self) -> DeploymentHandle:
        """The board's handle, made once and routing on this router's own loop (see the module's doc)."""
        if self._board is None:
            board = DeploymentHandle(BOARD, self.app_name)
            board._init(_run_router_in_separate_loop=False)
            self._board = board
        return self._board

    async def _follow(self) -> None:
        last_report = 0.0
        while time.monotonic() - self._last_request < self._idle_after_s:
            try:
                board = self._board_handle()
                index = self._routing.index
                index.apply(await board.page_changes.remote(self._deployment, index.seq, WAIT_FOR_CHANGES_S))
                report = {
                    **self._costs.summary(),
                    "follower_starts": self._follower_starts,
                    "pages_known": len(index),
                    "adapters_known": len(self._routing.adapters),
                    "recent": list(self._recent),
                }
                if report != self._reported and time.monotonic() - last_report >= REPORT_COSTS_S:
                    await board.report_routing.remote(self._name, report)
                    self._reported, last_report = report, time.monotonic()
            except Exception:  # the board may be restarting; routing goes on with what is known
                logger.warning("could not read the page directory", exc_info=True)
                await asyncio.sleep(1.0)
            await asyncio.sleep(self._refresh_s)


def _prompt_of(args: Sequence[Any]) -> tuple[list[int], str] | None:
    """(token ids, cache salt) of a generate request or a KV call, whose page hashes route it."""
    first = args[0] if args else None
    if isinstance(first, EncodedRequest):
        return first.prompt_ids, first.prefix_salt
    if isinstance(first, (LookupKV, RetrieveKV, StoreKV)):
        return first.tokens, first.tenant_salt
    return None


def _trace(pending_request: PendingRequest | None, ranked: list[list[str]], seconds: float) -> None:
    """A `route` span of the decision that just took `seconds`, in the request's trace (where tracing is on):
    the replicas it ranked first."""
    first = pending_request.args[0] if pending_request is not None and pending_request.args else None
    if not isinstance(first, EncodedRequest) or not first.trace_context:
        return
    now = time.time_ns()
    span = tracing.tracer().start_span("route", context=tracing.parent(first.trace_context), start_time=now - int(seconds * 1e9))
    span.set_attribute("serve_app.replicas_first", list(ranked[0]) if ranked else [])
    span.end(end_time=now)


def _adapter_of(args: Sequence[Any]) -> str | None:
    """The LoRA adapter a generate request runs with."""
    first = args[0] if args else None
    return first.request.lora if isinstance(first, EncodedRequest) else None
