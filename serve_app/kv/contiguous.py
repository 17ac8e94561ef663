"""ContiguousCache: one fixed slot of `max_seq_len` tokens per task, no sharing."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from serve_app.kv.base import CacheUsage, KVCache
from serve_app.kv.storage import KVShape, Storage
from serve_app.kv.view import BatchEntry, KVCacheView

_PAGE_SIZE = 16


class ContiguousCacheView(KVCacheView):
    """The view over slots: each task's context is the front of its own slot."""

    def __init__(self, storage: Storage, entries: Sequence[BatchEntry], slots: Sequence[int], pages_per_slot: int) -> None:
        tables = [range(slot * pages_per_slot, (slot + 1) * pages_per_slot) for slot in slots]
        super().__init__(storage, entries, tables)


class ContiguousCache(KVCache):
    """`n_slots` slots, each `[max_seq_len, n_kv_heads, head_dim]` per layer, laid out contiguously.

    A slot is stored as consecutive pages of the shared `Storage`, so the attention view reads
    it exactly as it reads pages.
    """

    def __init__(self, shape: KVShape, num_tokens: int, max_seq_len: int, device: torch.device) -> None:
        self.pages_per_slot = -(-max_seq_len // _PAGE_SIZE)
        self.max_seq_len = max_seq_len
        self.n_slots = num_tokens // (self.pages_per_slot * _PAGE_SIZE)
        if self.n_slots < 1:
            raise ValueError(
                f"cache size: {num_tokens} tokens cannot hold one contiguous slot of max_model_len={max_seq_len}"
            )
        self.storage = Storage(shape, self.n_slots * self.pages_per_slot, _PAGE_SIZE, device)
        self._free = list(range(self.n_slots - 1, -1, -1))
        self._slot_of: dict[int, int] = {}

    @property
    def max_task_tokens(self) -> int:
        return self.max_seq_len

    def admit(self, task_id: int, tokens: Sequence[int], prefix_salt: str) -> int | None:
        if not self._free:
            return None
        self._slot_of[task_id] = self._free.pop()
        return 0

    def grow(self, task_id: int, num_tokens: int) -> bool:
        return num_tokens <= self.max_seq_len

    def commit(self, task_id: int, tokens: Sequence[int], num_computed: int) -> None:
        """Nothing to publish: contiguous slots are never shared."""

    def release(self, task_id: int) -> None:
        slot = self._slot_of.pop(task_id, None)
        if slot is not None:
            self._free.append(slot)

    def view(self, entries: Sequence[BatchEntry]) -> ContiguousCacheView:
        slots = [self._slot_of[entry.task_id] for entry in entries]
        return ContiguousCacheView(self.storage, entries, slots, self.pages_per_slot)

    def usage(self) -> CacheUsage:
        return CacheUsage(total=self.n_slots, free=len(self._free))
