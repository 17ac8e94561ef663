"""The paged decode-attention kernel: `paged_decode.c`, built once per machine and called through ctypes.

On CPU with float32 the decode rows of a step attend straight from the cache's pages. The
torch path instead gathers every decode group's context into a padded copy, per layer, and
runs SDPA over it; at 128 sequences that copy and the padding cost most of the attention time.
The library is compiled with the system's C compiler (`$CC`, else `cc`) into
`<cache_dir>/kernels/`, keyed by the source, the flags, the compiler and the CPU, so a shared
cache directory never hands one CPU a build made for another. Where it cannot be built (no
compiler), or on CUDA, or for other dtypes, the torch path runs.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


class KernelBuildError(RuntimeError):
    """The kernel could not be compiled or loaded on this machine."""


class DecodeKernel:
    """Calls `paged_decode_attention` on torch tensors (CPU, float32)."""

    def __init__(self, library: Path) -> None:
        self.library = library
        function = ctypes.CDLL(str(library)).paged_decode_attention
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        function.argtypes = [pointer] * 6 + [size] * 6 + [ctypes.c_float, ctypes.c_int]
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
            if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise ValueError("decode kernel: query and k/v must be contiguous float32 CPU tensors")
        for tensor in (page_tables, context_lens):
            if tensor.dtype != torch.int64 or not tensor.is_contiguous():
                raise ValueError("decode kernel: page tables and context lengths must be contiguous int64")
        if page_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
            raise ValueError("decode kernel: one page table and one context length per query row")
        out = torch.empty_like(query)
        status = self._function(
            query.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr(), page_tables.data_ptr(),
            context_lens.data_ptr(), out.data_ptr(), num_seqs, n_heads, n_kv_heads, head_dim, page_size,
            page_tables.shape[1], scale, torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("decode kernel: could not allocate its score buffers")
        return out


def _compiler() -> str:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C compiler: {compiler!r} is not on PATH")
    return compiler


def _build_key(compiler: str) -> str:
    """A digest of everything the binary depends on: source, flags, compiler and CPU."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    cpu = platform.machine()
    if Path("/proc/cpuinfo").is_file():
        cpu += next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(), cpu.encode()):
        digest.update(part)
    return digest.hexdigest()[:16]


def build_decode_kernel(cache_dir: Path) -> DecodeKernel:
    """Compile the kernel into `cache_dir/kernels` unless already there, and load it."""
    compiler = _compiler()
    target = Path(cache_dir) / "kernels" / f"paged_decode-{_build_key(compiler)}.so"
    if not target.is_file():
        try:
            _compile(compiler, target)
        except OSError as error:  # e.g. a read-only cache directory
            raise KernelBuildError(f"cannot build into {target.parent}: {error}") from error
    try:
        return DecodeKernel(target)
    except OSError as error:
        raise KernelBuildError(f"cannot load {target}: {error}") from error


def _compile(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise KernelBuildError(f"{compiler} failed to build {SOURCE.name}:\n{result.stderr.strip()}")
        os.replace(built, target)  # atomic: concurrent builders each install a whole file


def load_decode_kernel(cache_dir: Path, device: torch.device, dtype: torch.dtype) -> DecodeKernel | None:
    """The kernel where it applies (CPU, float32) and builds; None means the torch path."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    try:
        kernel = build_decode_kernel(cache_dir)
    except KernelBuildError as error:
        logger.warning("decode attention falls back to torch (gather + SDPA): %s", error)
        return None
    logger.info("decode attention: paged kernel %s", kernel.library.name)
    return kernel
