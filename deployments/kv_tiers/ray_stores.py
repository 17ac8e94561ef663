"""The tiers reached through Ray: `HostStore`, this node's `NodePageStore`, and `ClusterStore`, the
stores of the other nodes (the one holding the longest run of a prompt's pages is read). `ray_tiers` is
what an engine is handed to build them (`InferenceEngine(ray_tiers=...)`; the engine deployment's
process does so)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import ray

from deployments.kv_tiers.node_store import NAMESPACE, node_store, store_name
from serve_app.config import KVTiersConfig
from serve_app.kv.tiers.pages import PageKey
from serve_app.kv.tiers.store import PageSource, PageStore, StoreUsage

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0
# How often the host tier's usage is asked for.
USAGE_EVERY_S = 1.0
# How long the cluster tier trusts its list of other nodes' stores.
NODES_TTL_S = 10.0


def ray_tiers(config: KVTiersConfig) -> tuple[list[PageStore], list[PageSource]]:
    """The host tier (a store) and the cluster tier (read only) that `config` asks for, on its Ray cluster."""
    node_id = connect(config.ray_address, config.node_id)
    stores: list[PageStore] = [HostStore(node_id, int(config.host_bytes))] if config.host_bytes is not None else []
    others: list[PageSource] = [ClusterStore(node_id)] if config.cluster else []
    return stores, others


def connect(address: str | None, node_id: str | None) -> str:
    """Join the Ray cluster (the current connection, else `address`, else "auto"); the node whose host
    tier this engine uses (`node_id`, else the connection's own)."""
    if not ray.is_initialized():
        try:
            ray.init(address=address or "auto", namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
        except ConnectionError as error:
            raise ValueError(
                "kv_tiers: host_bytes and cluster keep pages in a Ray cluster, and none was found "
                f"({error}); start one (ray start --head), serve the engine with serve run, or use disk_path alone"
            ) from error
    return node_id or ray.get_runtime_context().get_node_id()


def _fetch(store: ray.actor.ActorHandle, keys: Sequence[PageKey]) -> list[np.ndarray]:
    refs = ray.get(store.get.remote(list(keys)), timeout=CALL_TIMEOUT_S)
    # Writable copies: the engine's tensors are made from them.
    return [np.array(page) for page in ray.get(refs, timeout=CALL_TIMEOUT_S)] if refs else []


class HostStore(PageStore):
    name = "host"

    def __init__(self, node_id: str, capacity_bytes: int) -> None:
        self._store = node_store(node_id, capacity_bytes)
        self._usage = StoreUsage()
        self._asked: ray.ObjectRef | None = None
        self._asked_at = 0.0

    def held(self, keys: Sequence[PageKey]) -> int:
        return ray.get(self._store.held.remote(list(keys)), timeout=CALL_TIMEOUT_S)

    def read(self, keys: Sequence[PageKey]) -> list[np.ndarray]:
        return _fetch(self._store, keys)

    def write(self, keys: Sequence[PageKey], pages: Sequence[np.ndarray]) -> None:
        self._usage = ray.get(self._store.put.remote(list(keys), list(pages)), timeout=CALL_TIMEOUT_S)

    def usage(self) -> StoreUsage:
        """The store's usage as last heard, asked again (without waiting) at most every USAGE_EVERY_S:
        other engines on the node change it too."""
        if self._asked is not None and ray.wait([self._asked], timeout=0)[0]:
            try:
                self._usage = ray.get(self._asked)
            except Exception:
                logger.warning("the host tier did not say its usage", exc_info=True)
            self._asked = None
        if self._asked is None and time.monotonic() - self._asked_at > USAGE_EVERY_S:
            self._asked, self._asked_at = self._store.usage.remote(), time.monotonic()
        return self._usage


class ClusterStore(PageSource):
    """Reads only: each node's engines write to their own node's store."""

    name = "cluster"

    def __init__(self, own_node_id: str) -> None:
        self._own = own_node_id
        self._stores: list[ray.actor.ActorHandle] = []
        self._listed_at = -NODES_TTL_S

    def _others(self) -> list[ray.actor.ActorHandle]:
        if time.monotonic() - self._listed_at > NODES_TTL_S:
            stores = []
            for node in ray.nodes():
                if not node["Alive"] or node["NodeID"] == self._own:
                    continue
                try:
                    stores.append(ray.get_actor(store_name(node["NodeID"]), namespace=NAMESPACE))
                except ValueError:
                    continue  # no engine with a host tier has run there
            self._stores, self._listed_at = stores, time.monotonic()
        return self._stores

    def _longest(self, keys: Sequence[PageKey]) -> tuple[ray.actor.ActorHandle | None, int]:
        stores = self._others()
        if not stores:
            return None, 0
        counts = ray.get([store.held.remote(list(keys)) for store in stores], timeout=CALL_TIMEOUT_S)
        best = max(range(len(stores)), key=counts.__getitem__)
        return stores[best], counts[best]

    def held(self, keys: Sequence[PageKey]) -> int:
        return self._longest(keys)[1]

    def read(self, keys: Sequence[PageKey]) -> list[np.ndarray]:
        store, count = self._longest(keys)
        if store is None or count == 0:
            return []
        return _fetch(store, keys[:count])

    def usage(self) -> StoreUsage:
        return StoreUsage()  # what the other nodes hold is theirs to report
