"""Builds the KV cache a `CacheConfig` asks for, sized in tokens, in bytes, or (on CUDA, with
neither set) from the device's free memory."""

from __future__ import annotations

import torch

from serve_app.config import DEFAULT_CACHE_TOKENS, CacheConfig
from serve_app.kv.base import KVCache
from serve_app.kv.contiguous import ContiguousCache
from serve_app.kv.page_cache import PageCache
from serve_app.kv.storage import KVShape


def build_kv_cache(
    config: CacheConfig, shape: KVShape, max_model_len: int, device: torch.device, activation_bytes: int = 0
) -> KVCache:
    num_tokens = cache_tokens(config, shape, device, activation_bytes)
    if config.kind == "contiguous":
        return ContiguousCache(shape, num_tokens, max_model_len, device)
    return PageCache(shape, num_tokens, config.page_size, device, config.enable_prefix_caching)


def cache_tokens(config: CacheConfig, shape: KVShape, device: torch.device, activation_bytes: int = 0) -> int:
    """The cache's size in tokens. On CUDA with no size set, as vLLM's `gpu_memory_utilization`: the
    process may hold that share of the device's memory; what the model (and anything else on the
    device) already holds and `activation_bytes` (the largest step's activations) come off it."""
    if config.num_tokens is not None:
        return config.num_tokens
    if config.num_bytes is not None:
        return max(1, config.num_bytes // shape.bytes_per_token)
    if device.type != "cuda":
        return DEFAULT_CACHE_TOKENS
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * config.gpu_memory_utilization) - (total - free) - activation_bytes
    if budget < config.page_size * shape.bytes_per_token:
        raise ValueError(
            f"gpu_memory_utilization: {config.gpu_memory_utilization} of {total / 2**30:.1f} GiB leaves no room for "
            f"the KV cache ({(total - free) / 2**30:.1f} GiB in use, {activation_bytes / 2**30:.2f} GiB kept for "
            "activations): raise it, or set cache_tokens"
        )
    return budget // shape.bytes_per_token
