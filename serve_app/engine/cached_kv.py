"""CachedKV: the engine's side of the KV SDK. Lookup, retrieval and storage of cached whole-page prefixes by
token ids, run on the engine loop's thread between steps (where the cache may be touched), and where each
page is held (the pool or a KV tier)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from serve_app.engine.loop import EngineLoop
from serve_app.kv.prefix_cache import page_hashes
from serve_app.kv.tiers.tier_chain import TierChain
from serve_app.kv.transfer import KVTransfer
from serve_app.model.runner import ModelRunner
from serve_app.wire.calls import KVConfig, KVLookup, StoreResult
from serve_app.wire.refusals import InvalidRequestError


class CachedKV:
    def __init__(self, transfer: KVTransfer | None, runner: ModelRunner, loop: EngineLoop, tiers: TierChain | None) -> None:
        self._transfer = transfer  # None: the cache is not paged, or prefix caching is off
        self.runner = runner
        self.loop = loop
        self.tiers = tiers

    @property
    def enabled(self) -> bool:
        return self._transfer is not None

    def config(self) -> KVConfig:
        """Page size, KV geometry and dtype, and the RoPE settings K was rotated with."""
        transfer = self._transfer_or_refuse()
        shape = self.runner.kv_shape
        rope_type, theta, inv_freq = self.runner.rotary()
        return KVConfig(
            page_size=transfer.page_size,
            n_layers=shape.n_layers,
            n_kv_heads=shape.n_kv_heads,
            head_dim=shape.head_dim,
            dtype=str(shape.dtype).removeprefix("torch."),
            rope_type=rope_type,
            rope_theta=theta,
            rotary_dim=2 * len(inv_freq),
            rope_inv_freq=tuple(inv_freq.tolist()),
        )

    def lookup(self, tokens: Sequence[int], tenant_salt: str = "") -> int:
        """How many leading tokens of `tokens`, in whole pages, are in the prefix cache."""
        transfer, ids = self._transfer_or_refuse(), _token_list(tokens)
        return self.loop.call(lambda: transfer.lookup(ids, tenant_salt))

    def locate(self, tokens: Sequence[int], tenant_salt: str = "") -> list[str]:
        """The tier holding each leading whole page of `tokens` held anywhere: "pool" (the engine's own
        pages), then "host", "disk" or "cluster" for the pages that continue beyond the pool."""
        transfer, ids = self._transfer_or_refuse(), _token_list(tokens)
        in_pool = self.loop.call(lambda: transfer.lookup(ids, tenant_salt)) // transfer.page_size
        where = ["pool"] * in_pool
        if self.tiers is not None:
            where += self.tiers.where(list(page_hashes(ids, transfer.page_size, tenant_salt))[in_pool:])
        return where

    def find(self, tokens: Sequence[int], tenant_salt: str = "") -> KVLookup:
        """The tokens of `tokens` in the pool (whole pages) and where each leading page is held."""
        pages = self.locate(tokens, tenant_salt)
        return KVLookup(pages.count("pool") * self._transfer_or_refuse().page_size, tuple(pages))

    def retrieve(self, tokens: Sequence[int], tenant_salt: str = "") -> torch.Tensor | None:
        """`[2, n_layers, T, n_kv_heads * head_dim]` for the longest cached whole-page prefix; None under a page."""
        transfer, ids = self._transfer_or_refuse(), _token_list(tokens)
        return self.loop.call(lambda: transfer.retrieve(ids, tenant_salt))

    def store(self, kv: torch.Tensor, tokens: Sequence[int], tenant_salt: str = "") -> bool:
        """Cache `kv` as the KV of `tokens` (whole pages); False when every page was cached already."""
        return self.store_pages(kv, tokens, tenant_salt).stored_pages > 0

    def store_pages(self, kv: torch.Tensor, tokens: Sequence[int], tenant_salt: str = "") -> StoreResult:
        """As `store`, answering how many pages were stored and how many were already cached."""
        transfer, ids = self._transfer_or_refuse(), _token_list(tokens)
        transfer.check(kv, ids)
        return self.loop.call(lambda: transfer.store(kv, ids, tenant_salt))

    def _transfer_or_refuse(self) -> KVTransfer:
        if self._transfer is None:
            raise InvalidRequestError("kv_cache", "cached KV needs the paged cache with prefix caching on")
        return self._transfer


def _token_list(tokens: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        return [int(t) for t in tokens.reshape(-1).tolist()]
    if isinstance(tokens, str) or not all(isinstance(t, int) for t in tokens):
        raise InvalidRequestError("tokens", "expected a list of token ids")
    return list(tokens)
