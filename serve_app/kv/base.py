"""The KV cache interface: `KVCache`, the memory of tasks' keys and values, and its `CacheUsage`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from serve_app.kv.storage import Storage
from serve_app.kv.view import BatchEntry, KVCacheView


@dataclass(frozen=True)
class CacheUsage:
    """Memory in the cache's own unit (pages, or slots for the contiguous cache)."""

    total: int
    free: int


class KVCache(ABC):
    """Memory for tasks' keys and values. The scheduler admits, grows, commits and releases tasks."""

    storage: Storage

    @property
    @abstractmethod
    def max_task_tokens(self) -> int:
        """The most tokens one task can ever hold."""

    @abstractmethod
    def admit(self, task_id: int, tokens: Sequence[int], prefix_salt: str) -> int | None:
        """Reserve memory for a task's prompt; return how many leading tokens are already cached, or None."""

    @abstractmethod
    def grow(self, task_id: int, num_tokens: int) -> bool:
        """Make room for the task to hold `num_tokens` in all; False when memory ran out."""

    @abstractmethod
    def commit(self, task_id: int, tokens: Sequence[int], num_computed: int) -> None:
        """The first `num_computed` of `tokens` now have their k/v written: publish what can be shared."""

    def pin(self, tokens: Sequence[int], prefix_salt: str, ttl_s: float) -> int:
        """Keep the cached prefix of `tokens` for `ttl_s` (a prompt-caching breakpoint); how many tokens that
        holds. A cache without shared pages keeps none."""
        return 0

    @abstractmethod
    def release(self, task_id: int) -> None:
        """The task is done or preempted: give its memory back."""

    @abstractmethod
    def view(self, entries: Sequence[BatchEntry]) -> KVCacheView:
        """The attention view for one step's batch."""

    @abstractmethod
    def usage(self) -> CacheUsage:
        """Total and free memory units."""
