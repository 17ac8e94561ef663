"""PrefixCache: full pages keyed by a chained hash of their tokens, the cache salt mixed into the first."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence

from serve_app.wire.page_events import DEFAULT_LIMIT, PageEventLog, PageHash


def chain_hash(parent: PageHash | None, tokens: Sequence[int], prefix_salt: str) -> PageHash:
    """hash(parent, tokens); the first page (no parent) mixes in the salt, so salts never share pages."""
    digest = hashlib.blake2b(digest_size=16)
    if parent is None:
        digest.update(b"salt\x00" + prefix_salt.encode("utf-8") + b"\x00")
    else:
        digest.update(parent)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def page_hashes(tokens: Sequence[int], page_size: int, prefix_salt: str, limit: int | None = None) -> Iterator[PageHash]:
    """The chained hash of each whole page of `tokens` in order (at most `limit` of them)."""
    parent: PageHash | None = None
    count = len(tokens) // page_size if limit is None else min(limit, len(tokens) // page_size)
    for index in range(count):
        parent = chain_hash(parent, tokens[index * page_size : (index + 1) * page_size], prefix_salt)
        yield parent


class PrefixCache:
    """Maps page hashes to the pages holding them, both ways; tells a `PageEventLog` what comes and goes."""

    def __init__(self) -> None:
        self._page_of: dict[PageHash, int] = {}
        self._hash_of: dict[int, PageHash] = {}
        self._events: PageEventLog | None = None

    def record_events(self, limit: int = DEFAULT_LIMIT) -> PageEventLog:
        """Log the hashes published and dropped from now on; the first drain is a snapshot of what is held."""
        self._events = PageEventLog(lambda: list(self._page_of), limit)
        return self._events

    def lookup(self, page_hash: PageHash) -> int | None:
        return self._page_of.get(page_hash)

    def insert(self, page_hash: PageHash, page: int) -> bool:
        """Publish a page; False when another page already holds this hash."""
        if page_hash in self._page_of:
            return False
        self._page_of[page_hash] = page
        self._hash_of[page] = page_hash
        if self._events is not None:
            self._events.stored(page_hash)
        return True

    def is_cached(self, page: int) -> bool:
        return page in self._hash_of

    def drop(self, page: int) -> None:
        """Forget a page (it is being evicted and reused)."""
        page_hash = self._hash_of.pop(page, None)
        if page_hash is not None:
            del self._page_of[page_hash]
            if self._events is not None:
                self._events.removed(page_hash)

    def __len__(self) -> int:
        return len(self._page_of)
