"""`KVCacheView`: one step's reads and writes of the cache, as the attention function sees them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from serve_app.kv.storage import Storage


@dataclass(frozen=True)
class BatchEntry:
    """One task's share of a forward: `num_new` tokens at positions `start .. start + num_new - 1`.

    `verifies`: a decode token followed by proposed tokens (speculative decoding); each of its
    tokens attends as a decode row of its own, over the context up to and including it.
    """

    task_id: int
    start: int
    num_new: int
    verifies: bool = False

    @property
    def end(self) -> int:
        return self.start + self.num_new

    @property
    def is_decode(self) -> bool:
        """Its tokens are decode rows: one new token, or a decode token and its proposals."""
        return self.num_new == 1 or self.verifies


@dataclass(frozen=True)
class DecodeRows:
    """The step's decode rows (the first `num_seqs` rows of the batch), one query token each.

    `page_tables` [S, max_pages] lists each row's storage pages in order (padded with page 0);
    `context_lens` [S] is how many tokens each one attends to, its own token included. A verifying
    entry gives several rows of the same sequence, their contexts one token longer each.
    """

    num_seqs: int
    page_tables: torch.Tensor
    context_lens: torch.Tensor


@dataclass
class AttentionGroup:
    """Rows of the packed batch whose attention runs as one SDPA call over a gathered context.

    `pages` [S, n_pages] indexes storage pages; the gathered context is cut to `context_len`.
    `mask` [S, 1, q_len, context_len] is True where a query may attend; None means plain causal.
    `context_is_new` says the context is exactly these rows' own k/v (a prefill from position
    0), so it needs no gather.
    """

    rows: slice
    num_seqs: int
    q_len: int
    pages: torch.Tensor
    context_len: int
    mask: torch.Tensor | None
    context_is_new: bool = False


class KVCacheView:
    """Where one step writes its new k/v, and what each row attends to.

    Decode rows (one query token each) come first and are described once, by `decode`: a paged
    kernel reads their context in place. For the torch path, `decode_groups` splits them into
    groups of similar context length, so that little padding is gathered and attended over.
    Each prefill chunk is a group of its own. Gathers go into buffers allocated once per step
    and reused by every layer.
    """

    def __init__(self, storage: Storage, entries: Sequence[BatchEntry], page_tables: Sequence[Sequence[int]]) -> None:
        self.storage = storage
        page_size = storage.page_size
        self.write_slots = torch.tensor(
            [
                page_tables[i][pos // page_size] * page_size + pos % page_size
                for i, entry in enumerate(entries)
                for pos in range(entry.start, entry.end)
            ],
            dtype=torch.long,
            device=storage.device,
        )
        num_decode = sum(1 for entry in entries if entry.is_decode)
        if not all(entry.is_decode for entry in entries[:num_decode]):
            raise ValueError("decode entries must come first in the batch")
        decodes = list(zip(entries[:num_decode], page_tables[:num_decode]))
        self._decode_lengths = [pos + 1 for entry, _ in decodes for pos in range(entry.start, entry.end)]
        self.decode = self._decode_rows([table for entry, table in decodes for _ in range(entry.num_new)]) if decodes else None
        self._decode_groups: list[AttentionGroup] | None = None
        self.prefill_groups: list[AttentionGroup] = []
        row = len(self._decode_lengths)
        for entry, table in zip(entries[num_decode:], page_tables[num_decode:]):
            self.prefill_groups.append(self._prefill_group(row, entry, table))
            row += entry.num_new
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _decode_rows(self, tables: Sequence[Sequence[int]]) -> DecodeRows:
        n_pages = -(-max(self._decode_lengths) // self.storage.page_size)
        padded = [list(t[:n_pages]) + [0] * (n_pages - min(len(t), n_pages)) for t in tables]
        device = self.storage.device
        return DecodeRows(
            num_seqs=len(tables),
            page_tables=torch.tensor(padded, dtype=torch.long, device=device),
            context_lens=torch.tensor(self._decode_lengths, dtype=torch.long, device=device),
        )

    @property
    def decode_groups(self) -> list[AttentionGroup]:
        """The decode rows as SDPA groups of similar context length (longest first), for the torch path."""
        if self._decode_groups is None:
            self._decode_groups = [
                self._decode_group(start, stop) for start, stop in _length_buckets(self._decode_lengths)
            ]
        return self._decode_groups

    def _decode_group(self, start: int, stop: int) -> AttentionGroup:
        assert self.decode is not None
        lengths = self.decode.context_lens[start:stop]
        context_len = max(self._decode_lengths[start:stop])
        n_pages = -(-context_len // self.storage.page_size)
        mask = torch.arange(context_len, device=self.storage.device)[None, :] < lengths[:, None]
        return AttentionGroup(
            rows=slice(start, stop),
            num_seqs=stop - start,
            q_len=1,
            pages=self.decode.page_tables[start:stop, :n_pages],
            context_len=context_len,
            mask=mask[:, None, None, :],
        )

    def _prefill_group(self, row: int, entry: BatchEntry, table: Sequence[int]) -> AttentionGroup:
        device = self.storage.device
        n_pages = -(-entry.end // self.storage.page_size)
        pages = torch.tensor([list(table[:n_pages])], dtype=torch.long, device=device)
        mask = None
        if entry.start > 0:
            query_pos = torch.arange(entry.start, entry.end, device=device)
            mask = (torch.arange(entry.end, device=device)[None, :] <= query_pos[:, None])[None, None]
        return AttentionGroup(
            rows=slice(row, row + entry.num_new),
            num_seqs=1,
            q_len=entry.num_new,
            pages=pages,
            context_len=entry.end,
            mask=mask,
            context_is_new=entry.start == 0,
        )

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the new tokens' k/v ([T, n_kv_heads, head_dim], post-RoPE) in their slots, in the cache's dtype."""
        self.storage.flat_k(layer).index_copy_(0, self.write_slots, key.to(self.storage.dtype))
        self.storage.flat_v(layer).index_copy_(0, self.write_slots, value.to(self.storage.dtype))

    def context(self, layer: int, group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's context k and v, gathered, as [S, n_kv_heads, context_len, head_dim] views."""
        k_buf, v_buf = self._buffer(group)
        flat_pages = group.pages.reshape(-1)
        torch.index_select(self.storage.k[layer], 0, flat_pages, out=k_buf)
        torch.index_select(self.storage.v[layer], 0, flat_pages, out=v_buf)
        shape = (group.num_seqs, -1, self.storage.n_kv_heads, self.storage.head_dim)
        k = k_buf.view(shape)[:, : group.context_len].transpose(1, 2)
        v = v_buf.view(shape)[:, : group.context_len].transpose(1, 2)
        return k, v

    def _buffer(self, group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
        key = group.rows.start  # groups never share rows
        if key not in self._buffers:
            shape = (group.pages.numel(), *self.storage.k.shape[2:])
            self._buffers[key] = (
                torch.empty(shape, dtype=self.storage.dtype, device=self.storage.device),
                torch.empty(shape, dtype=self.storage.dtype, device=self.storage.device),
            )
        return self._buffers[key]


def _length_buckets(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Split consecutive context lengths (longest first, but for a verifying entry's few rising ones) into runs
    whose later lengths are at least half the first's."""
    buckets: list[tuple[int, int]] = []
    start = 0
    for index in range(1, len(lengths) + 1):
        if index == len(lengths) or lengths[index] * 2 < lengths[start]:
            buckets.append((start, index))
            start = index
    return buckets
