"""KV caches: the `KVCache` interface (base), `ContiguousCache` (contiguous) and the paged `PageCache`
(page_cache), and the page hashes and events (prefix_cache, page_events) that need no torch."""
