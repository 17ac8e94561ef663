"""TierChain: the engine's tiers behind its page pool, and the two threads that move pages through them.

Down: every page the pool publishes is copied out (on the scheduler thread, one gather per round) and
written by the writer thread to each store, host then disk, so a page the pool evicts is already there.
The writer's queue is bounded; a batch that finds it full is dropped (those pages are recomputed if
needed again), so a slow disk never holds up the engine. Up: a prompt whose pages continue beyond the
pool is read by a loader thread from the first tier holding each run (host, disk, then other nodes'
hosts) while the scheduler runs other requests' steps; the scheduler then copies the pages in. Any
failure of a tier is a miss: the tokens are recomputed.

The tiers Ray holds (host, cluster) are built by what the engine was handed (`RayTiers`): Ray is the
business of `deployments/` (`deployments.kv_tiers.ray_stores.ray_tiers`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from serve_app.config import KVTiersConfig
from serve_app.kv.prefix_cache import PageHash
from serve_app.kv.storage import Storage
from serve_app.kv.tiers.disk import DiskStore
from serve_app.kv.tiers.pages import LoadedPages, PageKey, gather_pages, page_keys
from serve_app.kv.tiers.store import PageSource, PageStore, StoreUsage

logger = logging.getLogger(__name__)

# Builds the tiers a config keeps in a Ray cluster: (stores written to, sources only read).
RayTiers = Callable[[KVTiersConfig], tuple[list[PageStore], list[PageSource]]]

# Bytes of pages waiting for the writer at most; a batch past it is dropped.
WRITE_QUEUE_BYTES = 512 * 2**20
LOADER_THREADS = 2


class TierChain:
    """The tiers of one engine (`stores` are written to; `sources`, the stores then the cluster, are read
    in that order), its writer thread and its loader threads."""

    def __init__(
        self,
        config: KVTiersConfig,
        layout: bytes,
        page_bytes: int,
        on_loaded: Callable[[LoadedPages], None],
        ray_tiers: RayTiers | None = None,
    ) -> None:
        self.layout = layout
        self.page_bytes = page_bytes  # what every page of this layout holds; a page of another size is not loaded
        self._on_loaded = on_loaded
        self.stores, self.sources = _tiers(config, ray_tiers, page_bytes)
        self.writes_dropped = 0
        self.load_failures = 0
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._writes: queue.SimpleQueue[tuple[list[PageKey], list[np.ndarray]] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()
        self._loaders = ThreadPoolExecutor(LOADER_THREADS, thread_name_prefix="kv-tier-loader")

    # -- down: from the scheduler thread ----------------------------------------------------------
    def offload(self, storage: Storage, published: Sequence[tuple[PageHash, int]]) -> None:
        """Queue copies of these just-published pages for the stores (dropped if the queue is full)."""
        if not published or not self.stores:
            return
        size = len(published) * storage.shape.bytes_per_token * storage.page_size
        with self._lock:
            if self._queued_bytes + size > WRITE_QUEUE_BYTES:
                self.writes_dropped += len(published)
                return
            self._queued_bytes += size
        hashes = [page_hash for page_hash, _ in published]
        self._writes.put((page_keys(self.layout, hashes), gather_pages(storage, [page for _, page in published])))

    def _write_loop(self) -> None:
        while (batch := self._writes.get()) is not None:
            keys, pages = batch
            for store in self.stores:
                try:
                    store.write(keys, pages)
                except Exception:
                    logger.warning("the %s tier could not take %d pages", store.name, len(keys), exc_info=True)
            with self._lock:
                self._queued_bytes -= sum(page.nbytes for page in pages)

    # -- up: a loader thread reads, the scheduler is told ---------------------------------------
    def load(self, task_id: int, start: int, hashes: list[PageHash]) -> None:
        """Read pages `start`, `start + 1`, ... of a task's prompt (their hashes given) from the tiers;
        `on_loaded` gets them (maybe none) on a loader thread."""
        self._loaders.submit(self._load, task_id, start, hashes)

    def _load(self, task_id: int, start: int, hashes: list[PageHash]) -> None:
        keys = page_keys(self.layout, hashes)
        data: list[np.ndarray] = []
        tiers: list[str] = []
        try:
            progressed = True
            while progressed and len(data) < len(keys):
                progressed = False
                for source in self.sources:
                    pages = source.read(keys[len(data):])
                    whole = next((i for i, page in enumerate(pages) if page.nbytes != self.page_bytes), len(pages))
                    if whole < len(pages):  # a page of another size would not fit the pool: read it as a miss
                        logger.warning("the %s tier gave a page of %d bytes, not %d: it is recomputed",
                                       source.name, pages[whole].nbytes, self.page_bytes)
                        with self._lock:
                            self.load_failures += 1
                        pages = pages[:whole]
                    if pages:
                        data += pages
                        tiers += [source.name] * len(pages)
                        progressed = True
                        break
        except Exception:
            logger.warning("a KV tier failed to load pages: they are recomputed", exc_info=True)
            with self._lock:
                self.load_failures += 1
        self._on_loaded(LoadedPages(task_id, start, hashes[: len(data)], data, tiers))

    def where(self, hashes: Sequence[PageHash]) -> list[str]:
        """Which tier holds each page of a run that the pool does not (blocking; not on the scheduler thread)."""
        keys = page_keys(self.layout, hashes)
        found: list[str] = []
        progressed = True
        while progressed and len(found) < len(keys):
            progressed = False
            for source in self.sources:
                try:
                    count = source.held(keys[len(found):])
                except Exception:
                    logger.warning("the %s tier did not say what it holds", source.name, exc_info=True)
                    continue
                if count:
                    found += [source.name] * count
                    progressed = True
                    break
        return found

    @property
    def queued_bytes(self) -> int:
        """Bytes of pages copied out and not yet written to every store."""
        with self._lock:
            return self._queued_bytes

    def usage(self) -> dict[str, StoreUsage]:
        return {store.name: store.usage() for store in self.stores}

    def close(self) -> None:
        self._writes.put(None)
        self._writer.join(timeout=30)
        self._loaders.shutdown(wait=False, cancel_futures=False)


def _tiers(
    config: KVTiersConfig, ray_tiers: RayTiers | None, page_bytes: int
) -> tuple[list[PageStore], list[PageSource]]:
    stores: list[PageStore] = []
    others: list[PageSource] = []
    if config.needs_ray:
        if ray_tiers is None:
            raise ValueError(
                "kv_tiers: host_bytes and cluster keep pages in a Ray cluster: serve the engine with serve run, or "
                "hand an engine in process the Ray tiers (ray_tiers=deployments.kv_tiers.ray_stores.ray_tiers)"
            )
        stores, others = ray_tiers(config)
    if config.disk_path is not None:
        stores.append(DiskStore(Path(config.disk_path), int(config.disk_bytes), page_bytes))
    return stores, [*stores, *others]
