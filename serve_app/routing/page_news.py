"""PageNews: one engine deployment's page directory, and the news of its changes that routers wait on
(`changes(since, wait_s)` answers as soon as there is something after `since`, rather than being asked again
and again)."""

from __future__ import annotations

import asyncio

from serve_app.routing.page_directory import PageChanges, PageDirectory
from serve_app.wire.page_events import PageEventBatch


class PageNews:
    def __init__(self) -> None:
        self.directory = PageDirectory()
        self._news = asyncio.Event()  # set (and replaced) when the directory changes
        self._announced = 0

    def publish(self, replica_id: str, pages: PageEventBatch, page_size: int) -> None:
        self.directory.publish(replica_id, pages, page_size)
        self._announce()

    def forget(self, replica_ids: list[str]) -> None:
        for replica_id in replica_ids:
            self.directory.forget(replica_id)
        self._announce()

    async def changes(self, since: int, wait_s: float) -> PageChanges:
        """What the replicas gained and lost after `since` (see `PageDirectory.changes`); with nothing new yet,
        first up to `wait_s` for something to happen."""
        if since == self.directory.seq and wait_s > 0:
            try:
                await asyncio.wait_for(self._news.wait(), wait_s)
            except TimeoutError:
                pass
        return self.directory.changes(since)

    def _announce(self) -> None:
        if self.directory.seq != self._announced:
            self._announced = self.directory.seq
            self._news.set()
            self._news = asyncio.Event()
