"""PageCache: paged KV with prefix sharing, built from PagePool, TaskTable and Storage."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from serve_app.kv.base import CacheUsage, KVCache
from serve_app.kv.page_pool import PagePool
from serve_app.kv.prefix_cache import PageHash, chain_hash, page_hashes
from serve_app.kv.storage import KVShape, Storage
from serve_app.kv.task_table import TaskPages, TaskTable
from serve_app.kv.tiers.pages import LoadedPages
from serve_app.kv.view import BatchEntry, KVCacheView

_ADMISSION_RESERVE = 0.01


class PageCacheView(KVCacheView):
    """The view over pages: each task's context is gathered page by page from its page table."""

    def __init__(self, storage: Storage, entries: Sequence[BatchEntry], task_table: TaskTable) -> None:
        super().__init__(storage, entries, [task_table[entry.task_id].pages for entry in entries])


class PageCache(KVCache):
    """Pages of `page_size` tokens; tasks whose prompts share full leading pages share those pages."""

    def __init__(
        self, shape: KVShape, num_tokens: int, page_size: int, device: torch.device, enable_prefix_caching: bool = True
    ) -> None:
        n_pages = num_tokens // page_size
        if n_pages < 2:
            raise ValueError(f"cache size: {num_tokens} tokens make fewer than 2 pages of page_size={page_size}")
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = PagePool(n_pages, page_size)
        self.tasks = TaskTable()
        self.storage = Storage(shape, n_pages, page_size, device)
        self.reserve_pages = max(1, int(n_pages * _ADMISSION_RESERVE))

    @property
    def max_task_tokens(self) -> int:
        return (self.pool.n_pages - self.reserve_pages) * self.page_size

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _max_shared_pages(self, tokens: Sequence[int]) -> int:
        # The last token is always computed again: its logits pick the next token.
        return (len(tokens) - 1) // self.page_size

    def admit(self, task_id: int, tokens: Sequence[int], prefix_salt: str, loaded: LoadedPages | None = None) -> int | None:
        """As `KVCache.admit`; `loaded` pages (read from the tiers) continue the pool's match where they can."""
        matched: list[int] = []
        last_hash = None
        if self.enable_prefix_caching:
            matched, last_hash = self.pool.match_prefix(tokens, prefix_salt, self._max_shared_pages(tokens))
        offset, usable = 0, 0
        if loaded is not None:
            offset = len(matched) - loaded.start
            if 0 <= offset < len(loaded):
                usable = min(len(loaded) - offset, self._max_shared_pages(tokens) - len(matched))
        fresh = self.pool.allocate(self._pages_for(len(tokens)) - len(matched), keep_free=self.reserve_pages)
        if fresh is None:
            self.pool.release(matched)
            return None
        if usable > 0:
            assert loaded is not None
            loaded.write_into(self.storage, offset, fresh[:usable])
            for index, page in enumerate(fresh[:usable]):
                self.pool.publish(page, loaded.hashes[offset + index], record=False)  # the tiers hold it
            last_hash = loaded.hashes[offset + usable - 1]
        shared = len(matched) + usable
        self.tasks.add(
            task_id,
            TaskPages(
                prefix_salt=prefix_salt,
                pages=matched + fresh,
                cached_tokens=shared * self.page_size,
                num_published=shared,
                last_hash=last_hash,
            ),
        )
        return shared * self.page_size

    def pages_beyond_pool(self, tokens: Sequence[int], prefix_salt: str) -> tuple[int, list[PageHash]]:
        """The first page of `tokens` the pool lacks, and the hashes of it and of the whole pages after it
        that a request could share (what a tier might hold)."""
        hashes = list(page_hashes(tokens, self.page_size, prefix_salt, self._max_shared_pages(tokens)))
        start = next((i for i, page_hash in enumerate(hashes) if self.pool.prefix_cache.lookup(page_hash) is None),
                     len(hashes))
        return start, hashes[start:]

    def grow(self, task_id: int, num_tokens: int) -> bool:
        entry = self.tasks[task_id]
        missing = self._pages_for(num_tokens) - len(entry.pages)
        if missing <= 0:
            return True
        pages = self.pool.allocate(missing)
        if pages is None:
            return False
        entry.pages.extend(pages)
        return True

    def commit(self, task_id: int, tokens: Sequence[int], num_computed: int) -> None:
        if not self.enable_prefix_caching:
            return
        entry = self.tasks[task_id]
        size = self.page_size
        for index in range(entry.num_published, num_computed // size):
            entry.last_hash = chain_hash(entry.last_hash, tokens[index * size : (index + 1) * size], entry.prefix_salt)
            self.pool.publish(entry.pages[index], entry.last_hash)
            entry.num_published = index + 1

    def pin(self, tokens: Sequence[int], prefix_salt: str, ttl_s: float) -> int:
        return self.pool.pin(tokens, prefix_salt, ttl_s) if self.enable_prefix_caching else 0

    def release(self, task_id: int) -> None:
        entry = self.tasks.pop(task_id)
        if entry is not None:
            self.pool.release(entry.pages)

    def view(self, entries: Sequence[BatchEntry]) -> PageCacheView:
        return PageCacheView(self.storage, entries, self.tasks)

    def usage(self) -> CacheUsage:
        return CacheUsage(total=self.pool.n_pages, free=self.pool.num_free)
