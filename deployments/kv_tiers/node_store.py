"""NodePageStore: one Ray actor per node holding KV pages in the node's object store, least recently
used out past its capacity. Every engine on the node writes to it and reads from it, and it outlives
them (a detached actor), so a restarted engine finds its pages; engines on other nodes fetch from it
(the cluster tier), Ray moving the pages between nodes. The actor owns every page it holds: it `put`s
them itself, so a page never dies with the engine that wrote it."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from serve_app.kv.tiers.pages import PageKey
from serve_app.kv.tiers.store import StoreUsage

NAMESPACE = "serve_app_kv"


def store_name(node_id: str) -> str:
    return f"kv_pages:{node_id}"


@ray.remote(num_cpus=0, max_concurrency=8, max_restarts=-1)  # one that dies comes back empty
class NodePageStore:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self._pages: OrderedDict[PageKey, tuple[ray.ObjectRef, int]] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._evictions = 0
        self._lock = threading.Lock()

    def put(self, keys: Sequence[PageKey], pages: Sequence[np.ndarray]) -> StoreUsage:
        """Keep the pages not held yet; return the usage after."""
        for key, page in zip(keys, pages):
            with self._lock:
                if key in self._pages:
                    self._pages.move_to_end(key)
                    continue
            ref = ray.put(page)  # a copy the store owns; `page` lives in the caller's argument
            with self._lock:
                if key not in self._pages:
                    self._pages[key] = (ref, page.nbytes)
                    self._bytes += page.nbytes
                while self._bytes > self.capacity and self._pages:
                    _, (_, size) = self._pages.popitem(last=False)
                    self._bytes -= size
                    self._evictions += 1
        return self.usage()

    def held(self, keys: Sequence[PageKey]) -> int:
        return len(self._leading(keys))

    def get(self, keys: Sequence[PageKey]) -> list[ray.ObjectRef]:
        """References to the pages of the leading run held (the caller fetches them; a page evicted
        meanwhile stays alive while the caller holds its reference)."""
        return self._leading(keys)

    def _leading(self, keys: Sequence[PageKey]) -> list[ray.ObjectRef]:
        refs = []
        with self._lock:
            for key in keys:
                entry = self._pages.get(key)
                if entry is None:
                    break
                self._pages.move_to_end(key)
                refs.append(entry[0])
        return refs

    def usage(self) -> StoreUsage:
        with self._lock:
            return StoreUsage(self._bytes, len(self._pages), self._evictions)


def node_store(node_id: str, capacity_bytes: int) -> ray.actor.ActorHandle:
    """This node's store, started (pinned to the node, outliving its starter) unless one runs already."""
    return NodePageStore.options(
        name=store_name(node_id), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(capacity_bytes)
