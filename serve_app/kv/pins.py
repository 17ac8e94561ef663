"""PinTable: prefixes kept in the page pool for a while (a prompt-caching breakpoint's TTL). A pin holds a
reference on each of its pages, so they are not evicted, until it expires, or until an allocation needs the room:
then the pins that expire soonest go first (where the pool has KV tiers behind it, their pages have copies there,
so a released pin is demoted to a tier, not lost). Pins hold half the pool at most."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from serve_app.kv.prefix_cache import PageHash


@dataclass
class _Pin:
    pages: tuple[int, ...]
    expires: float


class PinTable:
    """Pinned page chains by the hash of their last page. `retain` and `release` take and drop references on the
    pool's pages; `num_free` is how many pages the pool could hand out now."""

    def __init__(
        self,
        max_pages: int,
        retain: Callable[[int], None],
        release: Callable[[Sequence[int]], None],
        num_free: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_pages = max_pages
        self._retain, self._release, self._num_free, self._clock = retain, release, num_free, clock
        self._pins: dict[PageHash, _Pin] = {}
        self._first_expiry = float("inf")  # no pin expires before this
        self.num_pages = 0  # references the pins hold

    def pin(self, key: PageHash, pages: Sequence[int], ttl_s: float) -> bool:
        """Keep `pages` (a chain ending at the page hashed `key`) for `ttl_s` from now; pinning a chain again
        extends it. False where the chain is longer than the pins may hold."""
        expires = self._clock() + ttl_s
        held = self._pins.get(key)
        if held is not None:
            held.expires = max(held.expires, expires)
            self._first_expiry = min(pin.expires for pin in self._pins.values())
            return True
        if len(pages) > self.max_pages:
            return False
        for page in pages:
            self._retain(page)
        self._pins[key] = _Pin(tuple(pages), expires)
        self._first_expiry = min(self._first_expiry, expires)
        self.num_pages += len(pages)
        while self.num_pages > self.max_pages:
            self._drop_soonest()
        return key in self._pins

    def expire(self) -> None:
        """Let go of the pins whose time is up (their pages stay cached, evictable as any other)."""
        now = self._clock()
        if now < self._first_expiry:
            return
        for key in [key for key, pin in self._pins.items() if pin.expires <= now]:
            self._drop(key)

    def make_room(self, pages: int) -> None:
        """Let go of pins, those that expire soonest first, until `pages` pages are free or none is left."""
        while self._pins and self._num_free() < pages:
            self._drop_soonest()

    def held_alone(self, refs: Callable[[int], int]) -> int:
        """Pinned pages no request holds (each page's references, `refs`, all the pins')."""
        counts = Counter(page for pin in self._pins.values() for page in pin.pages)
        return sum(1 for page, pins in counts.items() if refs(page) == pins)

    def _drop_soonest(self) -> None:
        self._drop(min(self._pins, key=lambda key: self._pins[key].expires))

    def _drop(self, key: PageHash) -> None:
        pin = self._pins.pop(key)
        self.num_pages -= len(pin.pages)
        self._release(pin.pages)
        self._first_expiry = min((p.expires for p in self._pins.values()), default=float("inf"))

    def __len__(self) -> int:
        return len(self._pins)
