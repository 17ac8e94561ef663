"""Builds the KV cache a `CacheConfig` asks for."""

from __future__ import annotations

import torch

from serve_app.config import CacheConfig
from serve_app.kv.base import KVCache
from serve_app.kv.contiguous import ContiguousCache
from serve_app.kv.page_cache import PageCache
from serve_app.kv.storage import KVShape


def build_kv_cache(config: CacheConfig, shape: KVShape, max_model_len: int, device: torch.device) -> KVCache:
    num_tokens = config.resolve_tokens(shape.bytes_per_token)
    if config.kind == "contiguous":
        return ContiguousCache(shape, num_tokens, max_model_len, device)
    return PageCache(shape, num_tokens, config.page_size, device, config.enable_prefix_caching)
