"""The KV cache interface: `KVCache` (memory for tasks) and `KVCacheView` (one step's reads and writes)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from serve_app.kv.storage import Storage


@dataclass(frozen=True)
class BatchEntry:
    """One task's share of a forward: `num_new` tokens at positions `start .. start + num_new - 1`."""

    task_id: int
    start: int
    num_new: int

    @property
    def end(self) -> int:
        return self.start + self.num_new


@dataclass
class AttentionGroup:
    """Rows of the packed batch whose attention runs as one kernel call.

    `blocks` [S, n_blocks] indexes storage blocks; the gathered context is cut to `context_len`.
    `mask` [S, 1, q_len, context_len] is True where a query may attend; None means plain causal.
    """

    rows: slice
    num_seqs: int
    q_len: int
    blocks: torch.Tensor
    context_len: int
    mask: torch.Tensor | None


class KVCacheView:
    """What the attention function sees for one step: where to write the new k/v, and each context.

    Decode tokens (one new token each) are computed together, in groups of similar context
    length so that little padding is attended over; each prefill chunk is a group of its own. Context gathers go into buffers allocated once per step and reused by every
    layer.
    """

    def __init__(self, storage: Storage, entries: Sequence[BatchEntry], block_tables: Sequence[Sequence[int]]) -> None:
        self.storage = storage
        device = storage.device
        block_len = storage.block_len
        self.write_slots = torch.tensor(
            [
                block_tables[i][pos // block_len] * block_len + pos % block_len
                for i, entry in enumerate(entries)
                for pos in range(entry.start, entry.end)
            ],
            dtype=torch.long,
            device=device,
        )
        self.groups: list[AttentionGroup] = []
        decode = [i for i, e in enumerate(entries) if e.num_new == 1]
        if decode != list(range(len(decode))):
            raise ValueError("decode entries must come first in the batch")
        for start, stop in _length_buckets([entries[i].end for i in decode]):
            self.groups.append(self._decode_group(start, entries[start:stop], block_tables[start:stop]))
        row = len(decode)
        for entry, table in zip(entries[len(decode) :], block_tables[len(decode) :]):
            self.groups.append(self._prefill_group(row, entry, table))
            row += entry.num_new
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _decode_group(
        self, row: int, entries: Sequence[BatchEntry], tables: Sequence[Sequence[int]]
    ) -> AttentionGroup:
        device = self.storage.device
        block_len = self.storage.block_len
        lengths = torch.tensor([e.end for e in entries], device=device)
        context_len = int(lengths.max())
        n_blocks = -(-context_len // block_len)
        blocks = torch.tensor(
            [list(t[:n_blocks]) + [0] * (n_blocks - min(len(t), n_blocks)) for t in tables],
            dtype=torch.long,
            device=device,
        )
        mask = torch.arange(context_len, device=device)[None, :] < lengths[:, None]
        return AttentionGroup(
            rows=slice(row, row + len(entries)),
            num_seqs=len(entries),
            q_len=1,
            blocks=blocks,
            context_len=context_len,
            mask=mask[:, None, None, :],
        )

    def _prefill_group(self, row: int, entry: BatchEntry, table: Sequence[int]) -> AttentionGroup:
        device = self.storage.device
        n_blocks = -(-entry.end // self.storage.block_len)
        blocks = torch.tensor([list(table[:n_blocks])], dtype=torch.long, device=device)
        mask = None
        if entry.start > 0:
            query_pos = torch.arange(entry.start, entry.end, device=device)
            mask = (torch.arange(entry.end, device=device)[None, :] <= query_pos[:, None])[None, None]
        return AttentionGroup(
            rows=slice(row, row + entry.num_new),
            num_seqs=1,
            q_len=entry.num_new,
            blocks=blocks,
            context_len=entry.end,
            mask=mask,
        )

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the new tokens' k/v ([T, n_kv_heads, head_dim], post-RoPE) in their slots."""
        self.storage.flat_k(layer).index_copy_(0, self.write_slots, key)
        self.storage.flat_v(layer).index_copy_(0, self.write_slots, value)

    def context(self, layer: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Group `index`'s context k and v as [S, n_kv_heads, context_len, head_dim] views."""
        group = self.groups[index]
        k_buf, v_buf = self._buffer(index, group)
        flat_blocks = group.blocks.reshape(-1)
        torch.index_select(self.storage.k[layer], 0, flat_blocks, out=k_buf)
        torch.index_select(self.storage.v[layer], 0, flat_blocks, out=v_buf)
        shape = (group.num_seqs, -1, self.storage.n_kv_heads, self.storage.head_dim)
        k = k_buf.view(shape)[:, : group.context_len].transpose(1, 2)
        v = v_buf.view(shape)[:, : group.context_len].transpose(1, 2)
        return k, v

    def _buffer(self, index: int, group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
        if index not in self._buffers:
            shape = (group.blocks.numel(), *self.storage.k.shape[2:])
            self._buffers[index] = (
                torch.empty(shape, dtype=self.storage.dtype, device=self.storage.device),
                torch.empty(shape, dtype=self.storage.dtype, device=self.storage.device),
            )
        return self._buffers[index]


def _length_buckets(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Split consecutive context lengths (longest first) into runs whose shortest is at least half the longest."""
    buckets: list[tuple[int, int]] = []
    start = 0
    for index in range(1, len(lengths) + 1):
        if index == len(lengths) or lengths[index] * 2 < lengths[start]:
            buckets.append((start, index))
            start = index
    return buckets


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
    def admit(self, task_id: int, tokens: Sequence[int], cache_salt: str) -> int | None:
        """Reserve memory for a task's prompt; return how many leading tokens are already cached, or None."""

    @abstractmethod
    def grow(self, task_id: int, num_tokens: int) -> bool:
        """Make room for the task to hold `num_tokens` in all; False when memory ran out."""

    @abstractmethod
    def commit(self, task_id: int, tokens: Sequence[int], num_computed: int) -> None:
        """The first `num_computed` of `tokens` now have their k/v written: publish what can be shared."""

    @abstractmethod
    def release(self, task_id: int) -> None:
        """The task is done or preempted: give its memory back."""

    @abstractmethod
    def view(self, entries: Sequence[BatchEntry]) -> KVCacheView:
        """The attention view for one step's batch."""

    @abstractmethod
    def usage(self) -> CacheUsage:
        """Total and free memory units."""
