"""Storage: the k and v tensors, `[n_layers, n_pages, page_size, n_kv_heads, head_dim]` each."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    """The per-token geometry of a model's KV: layers, KV heads, head size and dtype."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


class Storage:
    """Owns the cache tensors. A page holds `page_size` tokens: a page of the paged cache, or a piece of a contiguous slot."""

    def __init__(self, shape: KVShape, n_pages: int, page_size: int, device: torch.device) -> None:
        self.shape = shape
        self.n_pages = n_pages
        self.page_size = page_size
        self.device = device
        dims = (shape.n_layers, n_pages, page_size, shape.n_kv_heads, shape.head_dim)
        self.k = torch.zeros(dims, dtype=shape.dtype, device=device)
        self.v = torch.zeros(dims, dtype=shape.dtype, device=device)

    @property
    def n_kv_heads(self) -> int:
        return self.shape.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.shape.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.shape.dtype

    def flat_k(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s k as [n_pages * page_size, n_kv_heads, head_dim] (one row per token slot)."""
        return self.k[layer].view(-1, self.n_kv_heads, self.head_dim)

    def flat_v(self, layer: int) -> torch.Tensor:
        return self.v[layer].view(-1, self.n_kv_heads, self.head_dim)
