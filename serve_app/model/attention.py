"""Our attention function for transformers' `AttentionInterface`: cache write, then paged decode and prefill attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from serve_app.kv.view import KVCacheView
from serve_app.model.decode_kernel import DecodeKernel

ATTENTION_NAME = "serve_app_kv"


def kv_cache_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    kv_view: KVCacheView | None = None,
    decode_kernel: DecodeKernel | None = None,
    **_: object,
) -> tuple[torch.Tensor, None]:
    """Attention over the packed batch `[1, heads, T, head_dim]` (q, k, v after RoPE).

    The new k/v go into their cache slots first. The decode rows then attend over their pages,
    through `decode_kernel` where there is one, else as gathered groups; each prefill chunk
    attends over its own context. Returns `[1, T, heads, head_dim]` as transformers expects.
    """
    if kv_view is None:
        raise RuntimeError("kv_cache_attention needs the step's kv_view")
    layer = module.layer_idx
    kv_view.write(layer, key[0].transpose(0, 1), value[0].transpose(0, 1))
    queries = query[0].transpose(0, 1)  # [T, heads, head_dim]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    output = torch.empty_like(queries)
    decode = kv_view.decode
    if decode is not None and decode_kernel is not None:
        output[: decode.num_seqs] = decode_kernel(
            queries[: decode.num_seqs], kv_view.storage.k[layer], kv_view.storage.v[layer],
            decode.page_tables, decode.context_lens, scale,
        )
    elif decode is not None:
        n_kv_heads = key.shape[1]
        for group in kv_view.decode_groups:
            k, v = kv_view.context(layer, group)
            rows = queries[group.rows]
            # A kv head's query heads become its query rows, so no k/v is repeated.
            q = rows.view(group.num_seqs, n_kv_heads, -1, rows.shape[-1])
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale)
            output[group.rows] = out.reshape(group.num_seqs, *rows.shape[1:])
    for group in kv_view.prefill_groups:
        if group.context_is_new:
            k, v = key[:, :, group.rows], value[:, :, group.rows]
        else:
            k, v = kv_view.context(layer, group)
        q = queries[group.rows].view(1, group.q_len, -1, queries.shape[-1]).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=group.mask,
            scale=scale,
            is_causal=group.mask is None,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        output[group.rows] = out[0].transpose(0, 1)
    return output.unsqueeze(0), None


def no_mask(*_: object, **__: object) -> None:
    """The mask function for our attention: masks are built per group from the view, not by transformers."""
    return None


def register_attention() -> str:
    """Register the attention and mask functions with transformers (idempotent); return the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, kv_cache_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, no_mask)
    return ATTENTION_NAME
