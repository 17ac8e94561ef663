"""KV caches: the `KVCache` interface, `ContiguousCache` and the paged `PageCache`."""

from serve_app.kv.base import BatchEntry, CacheUsage, KVCache, KVCacheView
from serve_app.kv.contiguous import ContiguousCache, ContiguousCacheView
from serve_app.kv.page_cache import PageCache, PageCacheView
from serve_app.kv.storage import KVShape, Storage

__all__ = [
    "BatchEntry",
    "CacheUsage",
    "ContiguousCache",
    "ContiguousCacheView",
    "KVCache",
    "KVCacheView",
    "KVShape",
    "PageCache",
    "PageCacheView",
    "Storage",
]
