"""rerotate_k: move cached K to other positions by rotating its RoPE phase."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from serve_app.wire.calls import KVConfig

if TYPE_CHECKING:
    import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rerotate_k(
    kv: torch.Tensor,
    old_positions: Sequence[int] | torch.Tensor,
    new_positions: Sequence[int] | torch.Tensor,
    config: KVConfig,
) -> torch.Tensor:
    """`kv` `[2, n_layers, T, n_kv_heads * head_dim]` with K rotated from `old_positions` to `new_positions`.

    RoPE rotates each pair of K's rotary dims by `position * inv_freq`; rotations add, so moving a
    token rotates by `(new - old) * inv_freq`. V carries no position and is returned as it is.
    """
    import torch  # the SDK loads torch only where it works on a tensor

    old = torch.as_tensor(old_positions, dtype=torch.float64)
    new = torch.as_tensor(new_positions, dtype=torch.float64)
    if old.shape != (kv.shape[2],) or new.shape != (kv.shape[2],):
        raise ValueError(f"positions: need {kv.shape[2]} old and new positions, got {tuple(old.shape)} and {tuple(new.shape)}")
    n_layers, length = kv.shape[1], kv.shape[2]
    k = kv[0].reshape(n_layers, length, config.n_kv_heads, config.head_dim)
    inv_freq = torch.tensor(config.rope_inv_freq, dtype=torch.float64)
    angles = (new - old)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)[None, :, None, :]  # [1, T, 1, rotary_dim]
    rotary = k[..., : config.rotary_dim].double()
    turned = rotary * angles.cos() + _rotate_half(rotary) * angles.sin()
    k = torch.cat((turned.to(kv.dtype), k[..., config.rotary_dim :]), dim=-1)
    return torch.stack((k.reshape(n_layers, length, -1), kv[1]))
