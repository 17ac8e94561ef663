"""The products over a GGUF's own blocks: `gguf_matmul.c`, built once per machine (`native.py`) and called
through ctypes, on float32 rows: `matmul` straight from the codes (few rows), `dequantize` a range of output
channels back to the float32 weight (many rows, whose product then runs on the BLAS)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from serve_app.model.kernels.native import build_library

SOURCE = Path(__file__).with_name("gguf_matmul.c")
BLOCK = 32  # inputs a block's scale (and minimum) covers
CHANNELS = 4  # the kernel's output channels at a time: a weight's outputs are a multiple of it


@dataclass(frozen=True)
class BlockWeight:
    """A [out, in] weight in a GGUF's blocks of 32 inputs: `q4_1` codes [out, in / 2] uint8 (two a byte) with
    `minimums`, or `q8_0` codes [out, in] int8 without; float32 `scales` (and `minimums`) [out, in / 32]."""

    kind: str  # "q4_1" or "q8_0"
    codes: torch.Tensor
    scales: torch.Tensor
    minimums: torch.Tensor | None

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.scales.shape[1] * BLOCK

    def rows(self, index: torch.Tensor) -> BlockWeight:
        """The weight of output channels `index` only, in that order."""
        pick = lambda tensor: None if tensor is None else tensor[index].contiguous()  # noqa: E731
        return BlockWeight(self.kind, pick(self.codes), pick(self.scales), pick(self.minimums))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.minimums) if t is not None)


def block_weight_supported(out_features: int, in_features: int) -> bool:
    """Whether the kernel takes a weight of this shape."""
    return out_features % CHANNELS == 0 and in_features % BLOCK == 0


class GgufMatmul:
    """Calls the kernel's functions on torch tensors (CPU, float32 rows)."""

    def __init__(self, library: Path, loaded: ctypes.CDLL) -> None:
        self.library = library
        pointer, size, threads = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._q4_1 = loaded.q4_1_matmul
        self._q4_1.argtypes = [pointer, size, pointer, pointer, pointer, size, size, pointer, threads]
        self._q8_0 = loaded.q8_0_matmul
        self._q8_0.argtypes = [pointer, size, pointer, pointer, size, size, pointer, threads]
        for function in (self._q4_1, self._q8_0):
            function.restype = ctypes.c_int
        self._q4_1_dequantize = loaded.q4_1_dequantize
        self._q4_1_dequantize.argtypes = [pointer, pointer, pointer, size, size, size, pointer, threads]
        self._q8_0_dequantize = loaded.q8_0_dequantize
        self._q8_0_dequantize.argtypes = [pointer, pointer, size, size, size, pointer, threads]
        for function in (self._q4_1_dequantize, self._q8_0_dequantize):
            function.restype = None

    def matmul(self, rows: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
        """`rows` [M, in] (float32, CPU) times the weight: [M, out] float32."""
        if rows.dim() != 2 or rows.shape[1] != weight.in_features or rows.dtype != torch.float32:
            raise ValueError(f"gguf matmul: float32 rows of {weight.in_features} features, not {tuple(rows.shape)} {rows.dtype}")
        rows = rows.contiguous()
        out = rows.new_empty(rows.shape[0], weight.out_features)
        if weight.kind == "q4_1":
            status = self._q4_1(
                rows.data_ptr(), rows.shape[0], weight.codes.data_ptr(), weight.scales.data_ptr(),
                weight.minimums.data_ptr(), weight.in_features, weight.out_features, out.data_ptr(), torch.get_num_threads(),
            )
        else:
            status = self._q8_0(
                rows.data_ptr(), rows.shape[0], weight.codes.data_ptr(), weight.scales.data_ptr(), weight.in_features,
                weight.out_features, out.data_ptr(), torch.get_num_threads(),
            )
        if status != 0:
            raise MemoryError("gguf matmul: could not allocate the rows' block sums")
        return out

    def dequantize(self, weight: BlockWeight, first: int, out: torch.Tensor) -> torch.Tensor:
        """Output channels [first, first + len(out)) of the weight as float32, written into `out` [count, in]."""
        count = out.shape[0]
        if first < 0 or first + count > weight.out_features or out.shape[1] != weight.in_features or not out.is_contiguous():
            raise ValueError(f"gguf dequantize: channels {first}..{first + count} into {tuple(out.shape)}")
        if weight.kind == "q4_1":
            self._q4_1_dequantize(
                weight.codes.data_ptr(), weight.scales.data_ptr(), weight.minimums.data_ptr(), weight.in_features, first,
                count, out.data_ptr(), torch.get_num_threads(),
            )
        else:
            self._q8_0_dequantize(
                weight.codes.data_ptr(), weight.scales.data_ptr(), weight.in_features, first, count, out.data_ptr(),
                torch.get_num_threads(),
            )
        return out


def build_gguf_matmul(cache_dir: Path) -> GgufMatmul:
    """Compile the kernel into `cache_dir/kernels` unless already there, and load it (`KernelBuildError` where it
    cannot be built here)."""
    return GgufMatmul(*build_library(SOURCE, cache_dir))
