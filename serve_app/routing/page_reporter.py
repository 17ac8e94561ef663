"""PageReporter: an engine replica's reports to the board. Page events and load changes (running and waiting
requests) go out within `every_s`; the other stats with a heartbeat at least every `heartbeat_s` (the board
forgets a replica that falls silent). Every report costs CPU the engine's steps need, so nothing else goes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from serve_app.wire.page_events import PageEventBatch

logger = logging.getLogger(__name__)

Stats = dict[str, int]
# Send a report (the stats, the page events since the last one); True when the board has lost track of this
# replica's pages and needs a snapshot of them.
Send = Callable[[Stats, PageEventBatch], Awaitable[bool]]


class PageReporter:
    def __init__(
        self,
        read_stats: Callable[[], Stats | None],
        take_events: Callable[[], PageEventBatch],
        send: Send,
        resend_pages: Callable[[], None],
        every_s: float,
        heartbeat_s: float,
    ) -> None:
        self.read_stats = read_stats
        self.take_events = take_events
        self.send = send
        self.resend_pages = resend_pages
        self.every_s = every_s
        self.heartbeat_s = heartbeat_s

    async def run(self) -> None:
        """Report until `read_stats` answers None (the engine is gone: the board forgets the replica once it
        falls silent). A report the board did not take goes again, with the events since, at the next round."""
        last: Stats | None = None
        pages = PageEventBatch()
        waited = self.heartbeat_s
        while True:
            await asyncio.sleep(self.every_s)
            waited += self.every_s
            stats = self.read_stats()
            if stats is None:
                return
            pages = pages.followed_by(self.take_events())
            if not pages and _load(stats) == _load(last) and waited < self.heartbeat_s:
                continue
            try:
                lost_track = await self.send(stats, pages)
            except Exception:  # the board may be restarting; the next round retries with the same pages
                logger.warning("could not report to the board", exc_info=True)
                continue
            last, pages, waited = stats, PageEventBatch(), 0.0
            if lost_track:
                self.resend_pages()


def _load(stats: Stats | None) -> tuple[int, int] | None:
    return (stats["active_tasks"], stats["waiting_queue"]) if stats is not None else None
