"""The calls one can make of an engine besides generating: token counts, stats and cached KV.

Each is a small frozen dataclass, so that a call means the same in process
(`InferenceEngine.answer`), across the engine's process boundary and through a Ray handle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from serve_app.engine.request import GenerateRequest

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class CountTokens:
    """How many prompt tokens the engine would feed for `request` (chat template included)."""

    request: GenerateRequest


@dataclass(frozen=True)
class GetStats:
    """The engine's counters and queue lengths now."""


@dataclass(frozen=True)
class GetKVConfig:
    """What a KV tensor means: page size, geometry, dtype, RoPE (answers a `KVConfig`)."""


@dataclass(frozen=True)
class LookupKV:
    """How much of `tokens` is cached under `cache_salt`, and where (answers a `KVLookup`)."""

    tokens: list[int]
    cache_salt: str = ""


@dataclass(frozen=True)
class KVLookup:
    """`cached_tokens`: the leading tokens, in whole pages, in the engine's pool (what a retrieve returns);
    `pages`: the tier holding each leading page held anywhere ("pool", then "host", "disk" or "cluster")."""

    cached_tokens: int
    pages: tuple[str, ...]


@dataclass(frozen=True)
class RetrieveKV:
    """The KV of the longest cached whole-page prefix of `tokens` (None under one page)."""

    tokens: list[int]
    cache_salt: str = ""


@dataclass(frozen=True)
class StoreKV:
    """Cache `kv` as the KV of `tokens` under `cache_salt` (answers a `StoreResult`)."""

    kv: torch.Tensor
    tokens: list[int]
    cache_salt: str = ""


@dataclass(frozen=True)
class ListAdapters:
    """The LoRA adapters the engine can run with: its `lora_paths` and the adapter folders under its
    `dynamic_lora_loading_path`."""


EngineCall = CountTokens | GetStats | GetKVConfig | LookupKV | RetrieveKV | StoreKV | ListAdapters
