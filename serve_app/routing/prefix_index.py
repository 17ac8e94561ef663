"""PrefixIndex: a router's copy of the page directory (page hash -> replicas holding it), plus the
pages of prompts it has just sent somewhere, held provisionally until that replica's own events
arrive or a few seconds pass, so that a burst of requests sharing a prefix follows the first one."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from serve_app.routing.page_directory import PageChanges
from serve_app.wire.page_events import PageEventBatch, PageHash

PROVISIONAL_TTL_S = 10.0


class PrefixIndex:
    def __init__(self, provisional_ttl_s: float = PROVISIONAL_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.seq = 0
        self.page_size: int | None = None
        self._holders: dict[PageHash, set[str]] = {}
        self._pages: dict[str, set[PageHash]] = {}
        self._provisional: dict[PageHash, dict[str, float]] = {}  # hash -> replica -> until
        self._ttl = provisional_ttl_s
        self._clock = clock

    def apply(self, changes: PageChanges) -> None:
        """Follow the directory: its changes since `self.seq`."""
        if changes.reset:
            self._holders.clear()
            self._pages.clear()
        for replica, batch in changes.batches:
            self._apply(replica, batch)
        self.seq = changes.seq
        self.page_size = changes.page_size
        self._drop_expired()

    def _drop_expired(self) -> None:
        now = self._clock()
        for page_hash in list(self._provisional):
            self._provisional_holders(page_hash, now)

    def _apply(self, replica: str, batch: PageEventBatch) -> None:
        held = self._pages.setdefault(replica, set())
        if batch.snapshot is not None:
            for page_hash in held - batch.snapshot:
                self._unhold(page_hash, replica)
            for page_hash in batch.snapshot - held:
                self._hold(page_hash, replica)
        for page_hash in batch.removed & held:
            self._unhold(page_hash, replica)
        for page_hash in batch.stored - held:
            self._hold(page_hash, replica)
        if not held:
            del self._pages[replica]

    def _hold(self, page_hash: PageHash, replica: str) -> None:
        self._pages[replica].add(page_hash)
        self._holders.setdefault(page_hash, set()).add(replica)
        provisional = self._provisional.get(page_hash)
        if provisional is not None:
            provisional.pop(replica, None)

    def _unhold(self, page_hash: PageHash, replica: str) -> None:
        self._pages[replica].discard(page_hash)
        holders = self._holders.get(page_hash)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[page_hash]

    def note_routed(self, replica: str, hashes: Iterable[PageHash]) -> None:
        """`replica` is about to cache these pages (a request with this prompt was sent there)."""
        until = self._clock() + self._ttl
        for page_hash in hashes:
            self._provisional.setdefault(page_hash, {})[replica] = until

    def matched_pages(self, hashes: Sequence[PageHash], replicas: Iterable[str]) -> dict[str, int]:
        """How many leading pages of `hashes` each of `replicas` holds (those holding none left out)."""
        now = self._clock()
        alive = set(replicas)
        matched: dict[str, int] = {}
        for count, page_hash in enumerate(hashes, start=1):
            holding = self._holders.get(page_hash, set()) | self._provisional_holders(page_hash, now)
            alive &= holding
            if not alive:
                break
            for replica in alive:
                matched[replica] = count
        return matched

    def _provisional_holders(self, page_hash: PageHash, now: float) -> set[str]:
        entries = self._provisional.get(page_hash)
        if not entries:
            return set()
        for replica in [r for r, until in entries.items() if until <= now]:
            del entries[replica]
        if not entries:
            del self._provisional[page_hash]
        return set(entries)

    def __len__(self) -> int:
        """Distinct pages known to be held somewhere."""
        return len(self._holders)
