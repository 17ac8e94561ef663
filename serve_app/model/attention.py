"""Our attention for transformers' `AttentionInterface`: cache write, then paged decode and prefill attention.

The step's `KVCacheView` (and the decode kernel) reach the attention through `step_context`, not
through the model's arguments, and the attention itself is a custom op (`serve_app::paged_attention`)
on tensors only: `torch.compile` then traces a decoder layer as one graph with the attention an
opaque call inside it, as vLLM treats its attention op.

Of the attention variants transformers' model families pass to an attention function, a sliding
window is honoured by bounding the context to it (`attention_window`: within its window, sliding-window
attention is full attention); a model asking for any other (logit softcapping, attention sinks,
chunked attention) is refused at load, naming its config field.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from serve_app.kv.view import KVCacheView
from serve_app.model.kernels.decode_kernel import DecodeKernel

ATTENTION_NAME = "serve_app_kv"


class _Step(threading.local):
    view: KVCacheView | None = None
    decode_kernel: DecodeKernel | None = None


_step = _Step()


@contextmanager
def step_context(view: KVCacheView, decode_kernel: DecodeKernel | None) -> Iterator[None]:
    """Make `view` (and the kernel) the attention's for one forward on this thread."""
    _step.view, _step.decode_kernel = view, decode_kernel
    try:
        yield
    finally:
        _step.view = _step.decode_kernel = None


def kv_cache_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, None]:
    """transformers' side: `[1, heads, T, head_dim]` q, k, v (after RoPE) in, `[1, T, heads, head_dim]` out.
    A `sliding_window` is covered by the context bound the runner set (`attention_window`); the other
    keyword arguments are the forward's own (positions and the like), which attention does not need."""
    if softcap is not None or s_aux is not None:  # refused at load (`attention_window`); never computed wrong
        raise ValueError("this attention has no logit softcapping and no attention sinks")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    queries, keys, values = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, head_dim]
    if torch.compiler.is_compiling():
        # The layer's number as a tensor (`compiled.compile_layers` gives each attention one), so that
        # every decoder layer runs the same compiled graph.
        layer = getattr(module, LAYER_INDEX)
        return torch.ops.serve_app.paged_attention(queries, keys, values, layer, scale).unsqueeze(0), None
    return paged_attention_step(queries, keys, values, module.layer_idx, scale).unsqueeze(0), None


# The buffer holding an attention module's layer number, for the compiled graph.
LAYER_INDEX = "serve_app_layer_index"


@torch.library.custom_op("serve_app::paged_attention", mutates_args=())
def paged_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: torch.Tensor, scale: float
) -> torch.Tensor:
    """The op `torch.compile` sees: the current step's attention of layer `layer` (a 0-d tensor; see
    `paged_attention_step`)."""
    return paged_attention_step(query, key, value, int(layer), scale)


@paged_attention.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(query)


def paged_attention_step(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layer: int, scale: float
) -> torch.Tensor:
    """Attention of the packed batch: q `[T, heads, head_dim]`, k and v `[T, kv_heads, head_dim]`.

    The new k/v go into their cache slots first. The decode rows then attend over their pages,
    through the decode kernel where there is one, else as gathered groups; each prefill chunk
    attends over its own context.
    """
    kv_view, decode_kernel = _step.view, _step.decode_kernel
    if kv_view is None:
        raise RuntimeError("paged attention runs only inside a step_context")
    kv_view.write(layer, keys, values)
    output = torch.empty_like(queries)
    decode = kv_view.decode
    if decode is not None and decode_kernel is not None:
        output[: decode.num_seqs] = decode_kernel(
            queries[: decode.num_seqs], kv_view.storage.k[layer], kv_view.storage.v[layer],
            decode.page_tables, decode.context_lens, scale,
        )
    elif decode is not None:
        n_kv_heads = keys.shape[1]
        for group in kv_view.decode_groups:
            k, v = (x.to(queries.dtype) for x in kv_view.context(layer, group))
            rows = queries[group.rows]
            # A kv head's query heads become its query rows, so no k/v is repeated.
            q = rows.view(group.num_seqs, n_kv_heads, -1, rows.shape[-1])
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale)
            output[group.rows] = out.reshape(group.num_seqs, *rows.shape[1:])
    for group in kv_view.prefill_groups:
        if group.context_is_new:
            k, v = keys[group.rows].transpose(0, 1)[None], values[group.rows].transpose(0, 1)[None]
        else:
            k, v = (x.to(queries.dtype) for x in kv_view.context(layer, group))
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
    return output


# Config fields of attention variants this attention does not compute: a model that sets one is refused.
_UNSUPPORTED_VARIANTS = {
    "attn_logit_softcapping": "logit softcapping",
    "attention_chunk_size": "chunked attention",
    "sinks": "attention sinks",
}


def attention_window(model: torch.nn.Module) -> int | None:
    """The smallest sliding window of the model's attention layers (None: every layer attends to the whole
    context); ValueError naming the config field of a variant this attention does not compute."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for field, variant in _UNSUPPORTED_VARIANTS.items():
        if getattr(config, field, None) is not None or any(
            getattr(module, field, None) is not None for module in model.modules() if hasattr(module, "layer_idx")
        ):
            raise ValueError(f"{field}: the model asks for {variant}, which this server's attention does not compute")
    windows = [
        getattr(module, "sliding_window", getattr(config, "sliding_window", None))
        for module in model.modules()
        if hasattr(module, "layer_idx") and hasattr(module, "q_proj")
    ]
    return min((w for w in windows if w is not None), default=None)


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
