"""KV caches: the `KVCache` interface, `ContiguousCache` and the paged `PageCache`."""

from serve_app.kv.base import CacheUsage, KVCache
from serve_app.kv.contiguous import ContiguousCache, ContiguousCacheView
from serve_app.kv.page_cache import PageCache, PageCacheView
from serve_app.kv.storage import KVShape, Storage
from serve_app.kv.view import BatchEntry, KVCacheView

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
