"""TierLoading: the scheduler's side of the KV tiers. A waiting task whose prompt continues beyond the pool
is sent to the tier loaders once, and waits aside (not holding up the queue) until its pages arrive; then
it is admitted with them. Pages the pool publishes go down to the tiers after each round's calls and steps."""

from __future__ import annotations

from serve_app.engine.task import Task
from serve_app.kv.page_cache import PageCache
from serve_app.kv.tiers.pages import LoadedPages
from serve_app.kv.tiers.tier_chain import TierChain
from serve_app.wire.calls import TIER_NAMES


class TierLoading:
    """Only the scheduler thread calls it."""

    def __init__(self, cache: PageCache, chain: TierChain) -> None:
        self.cache = cache
        self.chain = chain
        self.loading: dict[int, Task] = {}
        self.hit_tokens = dict.fromkeys(TIER_NAMES, 0)

    def send(self, task: Task) -> bool:
        """Ask the tiers for the pages of `task`'s prompt that the pool lacks (once per admission);
        True when the task now waits for them."""
        if task.admission.tiers_asked:
            return False
        task.admission.tiers_asked = True
        start, hashes = self.cache.pages_beyond_pool(task.tokens, task.admission.prefix_salt)
        if not hashes:
            return False
        self.loading[task.task_id] = task
        self.chain.load(task.task_id, start, hashes)
        return True

    def arrived(self, loaded: LoadedPages) -> Task | None:
        """The task whose pages these are, holding them now (None if it ended meanwhile)."""
        task = self.loading.pop(loaded.task_id, None)
        if task is not None and len(loaded):
            task.admission.loaded = loaded
        return task

    def admit(self, task: Task) -> int | None:
        """`cache.admit` with the task's loaded pages; they are counted by tier once used."""
        loaded = task.admission.loaded
        cached = self.cache.admit(task.task_id, task.tokens, task.admission.prefix_salt, loaded)
        if cached is not None and loaded is not None:
            for tier, pages in loaded.used.items():
                self.hit_tokens[tier] += pages * self.cache.page_size
            task.admission.loaded = None
        return cached

    def forget(self, task: Task) -> bool:
        """Stop waiting for `task`'s pages (it ended); True if it was waiting."""
        return self.loading.pop(task.task_id, None) is not None

    def offload(self) -> None:
        self.chain.offload(self.cache.storage, self.cache.pool.take_published())
