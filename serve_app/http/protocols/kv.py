"""The `/v1/kv/*` wire format, shared by the routes and the SDK.

Lookup and retrieve take JSON (`tokens`, `cache_salt`). KV travels as a safetensors body: the
tensor `kv` `[2, n_layers, T, n_kv_heads * head_dim]`, on store also `tokens` (int64, `[T]`),
and the cache salt in the file's metadata.
"""

from __future__ import annotations

import json
import struct
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from serve_app.http.protocols.errors import invalid
from serve_app.http.protocols.fields import validate_body

if TYPE_CHECKING:
    import torch

MEDIA_TYPE = "application/octet-stream"


class TokensRequest(BaseModel):
    """The body of `/v1/kv/lookup` and `/v1/kv/retrieve`."""

    model_config = ConfigDict(extra="forbid")

    tokens: list[int] = Field(min_length=1)
    cache_salt: str = ""


def parse_tokens_request(body: Any) -> TokensRequest:
    return validate_body(TokensRequest, body)


def encode_kv(kv: torch.Tensor, tokens: list[int] | None = None, cache_salt: str | None = None) -> bytes:
    """A safetensors body holding `kv` (and, for a store, its tokens and salt)."""
    import torch  # here, not at import: the HTTP layer starts without torch
    from safetensors.torch import save

    tensors = {"kv": kv.contiguous()}
    if tokens is not None:
        tensors["tokens"] = torch.tensor(tokens, dtype=torch.int64)
    metadata = {"cache_salt": cache_salt} if cache_salt is not None else None
    return save(tensors, metadata)


def _metadata(body: bytes) -> dict[str, str]:
    (header_len,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8 : 8 + header_len])
    return header.get("__metadata__") or {}


def decode_kv(body: bytes) -> tuple[torch.Tensor, list[int] | None, str]:
    """(kv, tokens or None, cache salt) from a safetensors body; 400 naming what is wrong."""
    import torch
    from safetensors.torch import load

    try:
        tensors = load(body)
        metadata = _metadata(body)
    except Exception as error:  # safetensors raises its own error types for every malformation
        raise invalid(f"body: not a safetensors file ({error})", "body") from None
    if "kv" not in tensors:
        raise invalid("body: the safetensors file has no tensor named 'kv'", "kv")
    tokens = tensors.get("tokens")
    if tokens is not None and (tokens.dim() != 1 or tokens.dtype not in (torch.int64, torch.int32)):
        raise invalid(f"tokens: expected a 1-D int64 tensor, got {tokens.dtype} of shape {list(tokens.shape)}", "tokens")
    token_list = None if tokens is None else [int(t) for t in tokens.tolist()]
    return tensors["kv"], token_list, str(metadata.get("cache_salt", ""))
