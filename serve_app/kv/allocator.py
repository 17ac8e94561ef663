"""Allocator: page allocation, reference counts and LRU eviction of cached pages nobody references."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence


class Allocator:
    """Hands out page ids. A released page that holds a published prefix stays evictable in LRU order."""

    def __init__(self, n_pages: int, on_evict: Callable[[int], None]) -> None:
        self.n_pages = n_pages
        self._on_evict = on_evict
        self._free: deque[int] = deque(range(n_pages))
        self._refs = [0] * n_pages
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        """Pages that can be handed out now: never used, or cached and unreferenced."""
        return len(self._free) + len(self._evictable)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh pages with one reference each, or None (and nothing taken) if too few are free."""
        if count > self.num_free:
            return None
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                self._on_evict(page)
            self._refs[page] = 1
            pages.append(page)
        return pages

    def retain(self, page: int) -> None:
        """One more reference to a page (a prefix hit); an evictable page leaves the LRU."""
        if self._refs[page] == 0:
            del self._evictable[page]
        self._refs[page] += 1

    def release(self, pages: Sequence[int], is_cached: Callable[[int], bool]) -> None:
        """Drop one reference from each page; unreferenced cached pages become evictable, others free."""
        for page in pages:
            self._refs[page] -= 1
            if self._refs[page] < 0:
                raise RuntimeError(f"page {page} released more often than taken")
            if self._refs[page] == 0:
                if is_cached(page):
                    self._evictable[page] = None
                else:
                    self._free.append(page)
