"""PageDirectory: which engine replica holds which pages, as the replicas report them, and a bounded
log of the changes that routers follow with `changes(since)`. A router that is new, or has fallen
behind the log, gets the whole view instead (`reset`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from serve_app.wire.page_events import PageEventBatch, PageHash

DEFAULT_LOG_LENGTH = 4096


@dataclass(frozen=True)
class PageChanges:
    """Changes after sequence number `since` up to `seq`, in order. With `reset` they are the whole view
    (one snapshot per replica): what was known before is dropped first."""

    seq: int
    page_size: int | None
    batches: tuple[tuple[str, PageEventBatch], ...]
    reset: bool = False


class PageDirectory:
    def __init__(self, log_length: int = DEFAULT_LOG_LENGTH) -> None:
        self._pages: dict[str, set[PageHash]] = {}
        self._log: deque[tuple[int, str, PageEventBatch]] = deque(maxlen=log_length)
        self._seq = 0
        self.page_size: int | None = None

    @property
    def seq(self) -> int:
        """The number of the latest change."""
        return self._seq

    @property
    def replicas(self) -> list[str]:
        return list(self._pages)

    def pages_of(self, replica_id: str) -> frozenset[PageHash]:
        return frozenset(self._pages.get(replica_id, ()))

    def publish(self, replica_id: str, batch: PageEventBatch, page_size: int) -> None:
        """A replica's events (its first report is a snapshot of what it holds)."""
        self.page_size = page_size
        if not batch and replica_id in self._pages:
            return
        self._pages[replica_id] = batch.applied_to(self._pages.get(replica_id, set()))
        self._append(replica_id, batch)

    def forget(self, replica_id: str) -> None:
        """A replica that is gone: it holds nothing from now on."""
        if self._pages.pop(replica_id, None) is not None:
            self._append(replica_id, PageEventBatch(snapshot=frozenset()))

    def changes(self, since: int) -> PageChanges:
        oldest = self._log[0][0] if self._log else self._seq + 1
        if since > self._seq or since < oldest - 1:  # a router from before a restart, or left behind
            whole = tuple((replica, PageEventBatch(snapshot=frozenset(pages))) for replica, pages in self._pages.items())
            return PageChanges(self._seq, self.page_size, whole, reset=True)
        batches = tuple((replica, batch) for seq, replica, batch in self._log if seq > since)
        return PageChanges(self._seq, self.page_size, batches)

    def _append(self, replica_id: str, batch: PageEventBatch) -> None:
        self._seq += 1
        self._log.append((self._seq, replica_id, batch))
