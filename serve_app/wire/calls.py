"""The calls to an engine besides generating, and their replies: its stats, the KV layout, looking up, retrieving
and storing cached KV (the KV SDK's), its LoRA adapters."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The tiers a cached page can come from besides the engine's own pool.
TIER_NAMES = ("host", "disk", "cluster")
# The bounds of the tokens-per-step histogram an engine keeps (vLLM's `iteration_tokens_total`).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class GetStats:
    """The engine's counters and queue lengths now."""


@dataclass(frozen=True)
class GetKVConfig:
    """What a KV tensor means: page size, geometry, dtype, RoPE (answers a `KVConfig`)."""


@dataclass(frozen=True)
class LookupKV:
    """How much of `tokens` is cached under `tenant_salt`, and where (answers a `KVLookup`)."""

    tokens: list[int]
    tenant_salt: str = ""


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
    tenant_salt: str = ""


@dataclass(frozen=True)
class StoreKV:
    """Cache `kv` as the KV of `tokens` under `tenant_salt` (answers a `StoreResult`)."""

    kv: torch.Tensor
    tokens: list[int]
    tenant_salt: str = ""


@dataclass(frozen=True)
class ListAdapters:
    """The LoRA adapters the engine can run with: its `lora_paths` and the adapter folders under its
    `dynamic_lora_loading_path`."""


EngineCall = GetStats | GetKVConfig | LookupKV | RetrieveKV | StoreKV | ListAdapters


@dataclass(frozen=True)
class KVConfig:
    """What a KV tensor means: its page size, geometry, dtype, and the model's rotary embedding.

    `rope_inv_freq` holds the rotary frequencies of each of the `rotary_dim / 2` pairs of a head
    (pairs are `(i, i + rotary_dim / 2)`, as in Hugging Face models), so K can be moved to other
    positions whatever the RoPE variant.
    """

    page_size: int
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str
    rope_type: str
    rope_theta: float | None
    rotary_dim: int
    rope_inv_freq: tuple[float, ...]

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "rope_inv_freq": list(self.rope_inv_freq)}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> KVConfig:
        return cls(**{**data, "rope_inv_freq": tuple(data["rope_inv_freq"])})  # type: ignore[arg-type]

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # only where a tensor is made: the types here load no torch

        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class StoreResult:
    """How many pages a store wrote, and how many were already cached (and skipped)."""

    stored_pages: int
    deduplicated_pages: int
