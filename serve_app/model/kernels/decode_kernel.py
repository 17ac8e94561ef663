"""The paged decode-attention kernel: `paged_decode.c`, built once per machine (`native.py`) and
called through ctypes.

On CPU with float32 activations the decode rows of a step attend straight from the cache's pages, whose
elements are float32, bfloat16 or float16 (`kv_cache_dtype`), widened to float32 as they are read. The
torch path instead gathers every decode group's context into a padded copy, per layer, and
runs SDPA over it; at 128 sequences that copy and the padding cost most of the attention time.
Where it cannot be built (no compiler), or on CUDA, or for other activation dtypes, the torch path runs.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from serve_app.model.kernels.native import KernelBuildError, build_library

logger = logging.getLogger(__name__)

# The cache's element types the kernel reads, as `paged_decode.c`'s KvType numbers them.
KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

SOURCE = Path(__file__).with_name("paged_decode.c")


class DecodeKernel:
    """Calls `paged_decode_attention` on torch tensors (CPU, a float32 query; float32, bfloat16 or float16 pages)."""

    def __init__(self, library: Path, loaded: ctypes.CDLL) -> None:
        self.library = library
        function = loaded.paged_decode_attention
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        function.argtypes = [pointer] * 3 + [ctypes.c_int] + [pointer] * 3 + [size] * 6 + [ctypes.c_float, ctypes.c_int]
        function.restype = ctypes.c_int
        self._function = function

    def __call__(
        self,
        query: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        page_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Attention of `query` [S, n_heads, head_dim] over each sequence's first `context_lens` tokens.

        `k_pages`/`v_pages` are one layer of the cache, [n_pages, page_size, n_kv_heads,
        head_dim]; `page_tables` [S, max_pages] and `context_lens` [S] are int64.
        """
        query = query.contiguous()
        num_seqs, n_heads, head_dim = query.shape
        n_pages, page_size, n_kv_heads, kv_dim = k_pages.shape
        if kv_dim != head_dim or n_heads % n_kv_heads or v_pages.shape != k_pages.shape:
            raise ValueError(f"decode kernel: query {tuple(query.shape)} does not fit k/v {tuple(k_pages.shape)}")
        for tensor in (query, k_pages, v_pages):
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise ValueError("decode kernel: query and k/v must be contiguous CPU tensors")
        if query.dtype != torch.float32 or k_pages.dtype not in KV_TYPES or v_pages.dtype != k_pages.dtype:
            raise ValueError("decode kernel: a float32 query over float32, bfloat16 or float16 k/v")
        for tensor in (page_tables, context_lens):
            if tensor.dtype != torch.int64 or not tensor.is_contiguous():
                raise ValueError("decode kernel: page tables and context lengths must be contiguous int64")
        if page_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
            raise ValueError("decode kernel: one page table and one context length per query row")
        out = torch.empty_like(query)
        status = self._function(
            query.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr(), KV_TYPES[k_pages.dtype], page_tables.data_ptr(),
            context_lens.data_ptr(), out.data_ptr(), num_seqs, n_heads, n_kv_heads, head_dim, page_size,
            page_tables.shape[1], scale, torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("decode kernel: could not allocate its score buffers")
        return out


def build_decode_kernel(cache_dir: Path) -> DecodeKernel:
    """Compile the kernel into `cache_dir/kernels` unless already there, and load it."""
    return DecodeKernel(*build_library(SOURCE, cache_dir))


def load_decode_kernel(cache_dir: Path, device: torch.device, dtype: torch.dtype) -> DecodeKernel | None:
    """The kernel where it applies (CPU, float32 activations) and builds; None means the torch path."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    try:
        kernel = build_decode_kernel(cache_dir)
    except KernelBuildError as error:
        logger.warning("decode attention falls back to torch (gather + SDPA): %s", error)
        return None
    logger.info("decode attention: paged kernel %s", kernel.library.name)
    return kernel
