"""TierPages: whole KV pages as they travel between the pool and the tiers, and the keys they go under.

A page travels as its raw bytes, `[2, n_layers, page_size, n_kv_heads, head_dim]` (k then v) in the cache's
dtype, so every store handles one flat `uint8` array per page whatever the dtype. A page's key is the
pool's chained page hash (which covers the tenant's salt and the adapter) after the engine's layout key
(the model's weights, dtype, quantization, page size), so no two models share a key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from serve_app.kv.prefix_cache import PageHash
from serve_app.kv.storage import Storage

PageKey = bytes


def page_keys(layout: bytes, hashes: Sequence[PageHash]) -> list[PageKey]:
    return [layout + page_hash for page_hash in hashes]


def gather_pages(storage: Storage, pages: Sequence[int]) -> list[np.ndarray]:
    """A copy of each page's k and v, one flat byte array per page."""
    index = torch.tensor(list(pages), dtype=torch.long, device=storage.device)
    both = torch.stack([storage.k.index_select(1, index), storage.v.index_select(1, index)])  # [2, L, n, P, H, D]
    by_page = both.permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
    flat = by_page.view(torch.uint8).reshape(len(pages), -1).numpy()
    return list(flat)


@dataclass
class LoadedPages:
    """Pages a tier loader read for one task: the hashes of pages `start`, `start + 1`, ... and their bytes,
    each with the tier it came from. `used` says how many of them the cache took (the rest it had already)."""

    task_id: int
    start: int
    hashes: list[PageHash]
    data: list[np.ndarray]
    tiers: list[str]
    used: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.hashes)

    def write_into(self, storage: Storage, offset: int, pages: Sequence[int]) -> None:
        """Copy loaded pages `offset`, `offset + 1`, ... into the pool's `pages`, and count them as used."""
        shape = storage.shape
        dims = (2, shape.n_layers, storage.page_size, shape.n_kv_heads, shape.head_dim)
        for index, page in enumerate(pages):
            data = self.data[offset + index]
            kv = torch.from_numpy(data).view(shape.dtype).reshape(dims).to(storage.device)
            storage.k[:, page].copy_(kv[0])
            storage.v[:, page].copy_(kv[1])
            tier = self.tiers[offset + index]
            self.used[tier] = self.used.get(tier, 0) + 1
