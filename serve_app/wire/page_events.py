"""Page events: which page hashes a prefix cache has published and dropped, for whoever keeps a
view of what each engine holds (the request router's). Sets, so that only the latest event about
a hash counts; bounded, so that a log nobody drains falls back to one snapshot of the cache."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

PageHash = bytes
# Distinct hashes a log holds before it gives up on events and asks for a snapshot instead.
DEFAULT_LIMIT = 1 << 16


@dataclass(frozen=True)
class PageEventBatch:
    """What changed: `snapshot` (when set) replaces what was known, then `removed` go and `stored` come."""

    stored: frozenset[PageHash] = frozenset()
    removed: frozenset[PageHash] = frozenset()
    snapshot: frozenset[PageHash] | None = None

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.snapshot is not None)

    def followed_by(self, later: PageEventBatch) -> PageEventBatch:
        """One batch that means this batch, then `later`."""
        if later.snapshot is not None:
            return later
        if self.snapshot is not None:
            return PageEventBatch(snapshot=frozenset(later.applied_to(set(self.snapshot))))
        return PageEventBatch((self.stored - later.removed) | later.stored, (self.removed - later.stored) | later.removed)

    def applied_to(self, held: set[PageHash]) -> set[PageHash]:
        """`held` after this batch (a new set when there is a snapshot, else `held` itself, changed)."""
        result = set(self.snapshot) if self.snapshot is not None else held
        result -= self.removed
        result |= self.stored
        return result


@dataclass
class PageEventLog:
    """Events since the last `drain`, thread-safe. The first drain, and the first after `limit` distinct
    hashes have piled up, carry a snapshot made by `snapshot_of` (what the cache holds then) instead."""

    snapshot_of: Callable[[], Iterable[PageHash]]
    limit: int = DEFAULT_LIMIT
    _stored: set[PageHash] = field(default_factory=set)
    _removed: set[PageHash] = field(default_factory=set)
    _snapshot_due: bool = True
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def stored(self, page_hash: PageHash) -> None:
        with self._lock:
            self._removed.discard(page_hash)
            self._stored.add(page_hash)
            self._check_size()

    def removed(self, page_hash: PageHash) -> None:
        with self._lock:
            self._stored.discard(page_hash)
            self._removed.add(page_hash)
            self._check_size()

    def _check_size(self) -> None:
        if len(self._stored) + len(self._removed) > self.limit:
            self._stored.clear()
            self._removed.clear()
            self._snapshot_due = True

    def snapshot_next(self) -> None:
        """Make the next drain a snapshot (a reader has lost track)."""
        with self._lock:
            self._snapshot_due = True

    def drain(self) -> PageEventBatch:
        """The events since the last drain (empty when there are none)."""
        with self._lock:
            if self._snapshot_due:  # what is held now already says what the events would
                batch = PageEventBatch(snapshot=frozenset(self.snapshot_of()))
            else:
                batch = PageEventBatch(frozenset(self._stored), frozenset(self._removed))
            self._stored.clear()
            self._removed.clear()
            self._snapshot_due = False
            return batch


class PageEventBuffer:
    """Batches merged in order until taken: what an engine's host holds between two reports."""

    def __init__(self) -> None:
        self._batch = PageEventBatch()
        self._lock = threading.Lock()

    def add(self, batch: PageEventBatch) -> None:
        with self._lock:
            self._batch = self._batch.followed_by(batch)

    def take(self) -> PageEventBatch:
        with self._lock:
            batch, self._batch = self._batch, PageEventBatch()
            return batch
