"""PagePool: the allocator, the prefix cache and the pinned prefixes together, so evictions, hits and pins stay
consistent."""

from __future__ import annotations

from collections.abc import Sequence

from serve_app.kv.allocator import Allocator
from serve_app.kv.pins import PinTable
from serve_app.kv.prefix_cache import PageHash, PrefixCache, page_hashes


class PagePool:
    """Pages of `page_size` tokens: allocate, share by prefix, publish, pin and release."""

    def __init__(self, n_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.prefix_cache = PrefixCache()
        self.allocator = Allocator(n_pages, on_evict=self.prefix_cache.drop)
        self.pins = PinTable(n_pages // 2, self.allocator.retain, self.release, lambda: self.allocator.num_free)
        # Pages published since the last `take_published`, when something (the KV tiers) copies them out.
        self._published: list[tuple[PageHash, int]] | None = None

    @property
    def n_pages(self) -> int:
        return self.allocator.n_pages

    @property
    def num_free(self) -> int:
        """Pages an allocation can have: free, cached and unreferenced, or held by pins alone (let go for it)."""
        return self.allocator.num_free + self.pins.held_alone(self.allocator.refs)

    def match_prefix(self, tokens: Sequence[int], prefix_salt: str, max_pages: int) -> tuple[list[int], PageHash | None]:
        """Take a reference to each cached leading full page (at most `max_pages`); return them and the last hash."""
        pages: list[int] = []
        parent: PageHash | None = None
        for page_hash in page_hashes(tokens, self.page_size, prefix_salt, max_pages):
            page = self.prefix_cache.lookup(page_hash)
            if page is None:
                break
            self.allocator.retain(page)
            pages.append(page)
            parent = page_hash
        return pages, parent

    def allocate(self, count: int, keep_free: int = 0) -> list[int] | None:
        """`count` new pages, leaving at least `keep_free` free; None (nothing taken) if that cannot be done, even
        with the pins let go (expired ones first, then those that expire soonest)."""
        self.pins.expire()
        self.pins.make_room(count + keep_free)
        if count + keep_free > self.allocator.num_free:
            return None
        return self.allocator.allocate(count)

    def pin(self, tokens: Sequence[int], prefix_salt: str, ttl_s: float) -> int:
        """Keep the cached leading full pages of `tokens` for `ttl_s`; how many tokens that holds."""
        pages: list[int] = []
        last: PageHash | None = None
        for page_hash in page_hashes(tokens, self.page_size, prefix_salt):
            page = self.prefix_cache.lookup(page_hash)
            if page is None:
                break
            pages.append(page)
            last = page_hash
        if last is None or not self.pins.pin(last, pages, ttl_s):
            return 0
        return len(pages) * self.page_size

    def publish(self, page: int, page_hash: PageHash, record: bool = True) -> None:
        """Offer a fully written page to later requests (a no-op if the hash is already published)."""
        if self.prefix_cache.insert(page_hash, page) and record and self._published is not None:
            self._published.append((page_hash, page))

    def record_published(self) -> None:
        """From now on, keep the pages published (unless `record=False`) for `take_published`."""
        self._published = []

    def take_published(self) -> list[tuple[PageHash, int]]:
        """The (hash, page) pairs published since the last call. Take them before any allocation can
        evict one: a page evicted meanwhile would hold another prefix's tokens."""
        if not self._published:
            return []
        taken, self._published = self._published, []
        return taken

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference from each of a chain's pages, given in position order.

        They enter the eviction order tail first, so that under pressure a cached prefix loses
        its last pages before its first: a chain without its head could never be matched again.
        """
        self.allocator.release(pages[::-1], self.prefix_cache.is_cached)
