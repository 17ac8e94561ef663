"""KVTransfer: read and write a paged cache's prefix pages by token ids (the KV SDK's engine side).

KV travels as one tensor `[2, n_layers, T, n_kv_heads * head_dim]` (k then v; k after RoPE) for
the first `T` tokens, `T` a whole number of pages. Stored pages are published in the
prefix cache as a prefill's pages would be, so a request whose prompt starts with those tokens
reads them instead of computing them. Every method runs on the scheduler thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from serve_app.kv.page_cache import PageCache
from serve_app.kv.prefix_cache import page_hashes
from serve_app.wire.calls import StoreResult
from serve_app.wire.refusals import CacheFullError, InvalidRequestError


class KVTransfer:
    """Lookup, retrieval and storage of whole-page token prefixes in a `PageCache`."""

    def __init__(self, cache: PageCache, vocab_size: int) -> None:
        self.cache = cache
        self.vocab_size = vocab_size
        shape = cache.storage.shape
        self.row_width = shape.n_kv_heads * shape.head_dim

    @property
    def page_size(self) -> int:
        return self.cache.page_size

    def _cached_pages(self, tokens: Sequence[int], prefix_salt: str) -> list[int]:
        pages: list[int] = []
        for page_hash in page_hashes(tokens, self.page_size, prefix_salt):
            page = self.cache.pool.prefix_cache.lookup(page_hash)
            if page is None:
                break
            pages.append(page)
        return pages

    def lookup(self, tokens: Sequence[int], prefix_salt: str) -> int:
        """How many leading tokens, in whole pages, are cached."""
        return len(self._cached_pages(tokens, prefix_salt)) * self.page_size

    def retrieve(self, tokens: Sequence[int], prefix_salt: str) -> torch.Tensor | None:
        """The KV of the longest cached whole-page prefix of `tokens`, on the CPU; None under one page."""
        pages = self._cached_pages(tokens, prefix_salt)
        if not pages:
            return None
        storage = self.cache.storage
        index = torch.tensor(pages, dtype=torch.long, device=storage.device)
        n_layers = storage.shape.n_layers
        length = len(pages) * self.page_size
        k = storage.k.index_select(1, index).reshape(n_layers, length, self.row_width)
        v = storage.v.index_select(1, index).reshape(n_layers, length, self.row_width)
        return torch.stack([k, v]).cpu()

    def check(self, kv: torch.Tensor, tokens: Sequence[int]) -> None:
        """Raise InvalidRequestError unless `kv` and `tokens` fit this cache and each other."""
        shape = self.cache.storage.shape
        if not isinstance(kv, torch.Tensor):
            raise InvalidRequestError("kv", f"expected a tensor, got {type(kv).__name__}")
        expected = f"[2, {shape.n_layers}, T, {self.row_width}] (k and v, layers, tokens, kv heads x head dim)"
        if kv.dim() != 4 or kv.shape[0] != 2 or kv.shape[1] != shape.n_layers or kv.shape[3] != self.row_width:
            raise InvalidRequestError("kv", f"shape {list(kv.shape)} does not match {expected}")
        if kv.dtype != shape.dtype:
            raise InvalidRequestError("kv", f"dtype {str(kv.dtype).removeprefix('torch.')} does not match the cache's "
                                      f"{str(shape.dtype).removeprefix('torch.')}")
        if len(tokens) != kv.shape[2]:
            raise InvalidRequestError("tokens", f"{len(tokens)} tokens for KV of {kv.shape[2]} positions")
        bad = next((t for t in tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError("tokens", f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")

    def store(self, kv: torch.Tensor, tokens: Sequence[int], prefix_salt: str) -> StoreResult:
        """Write the whole pages of `kv` under `tokens`; pages already cached are skipped."""
        self.check(kv, tokens)
        size = self.page_size
        pool = self.cache.pool
        hashes = list(page_hashes(tokens, size, prefix_salt))
        cached = [pool.prefix_cache.lookup(page_hash) for page_hash in hashes]
        missing = [i for i, page in enumerate(cached) if page is None]
        if not missing:
            return StoreResult(0, len(hashes))
        # Hold the pages already cached while allocating, so that eviction cannot take them.
        for page in cached:
            if page is not None:
                pool.allocator.retain(page)
        pages = pool.allocate(len(missing), keep_free=self.cache.reserve_pages)
        if pages is None:
            pool.release([page for page in cached if page is not None])
            raise CacheFullError(f"the cache has too few free pages to store {len(missing)} pages now")
        chain = list(cached)
        for index, page in zip(missing, pages):
            chain[index] = page
        try:
            storage = self.cache.storage
            shape = storage.shape
            whole = len(hashes) * size
            by_page = kv[:, :, :whole].to(storage.device).reshape(2, shape.n_layers, -1, size, shape.n_kv_heads, shape.head_dim)
            for index, page in zip(missing, pages):
                storage.k[:, page].copy_(by_page[0, :, index])
                storage.v[:, page].copy_(by_page[1, :, index])
                pool.publish(page, hashes[index])
        finally:
            # Whatever happened, every page goes back: published ones stay cached, the rest are free.
            pool.release(chain)
        return StoreResult(len(missing), len(hashes) - len(missing))
