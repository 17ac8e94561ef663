"""The one-row int8 product: `int8_gemv.c`, built once per machine (`native.py`) and called through
ctypes, for the int8 layers of a step with one row, where fbgemm's fixed cost per call (about 27 us
even for a 576 x 192 layer) is most of a layer's time. Where it cannot be built, fbgemm runs every
step."""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from serve_app.model.kernels.native import KernelBuildError, build_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("int8_gemv.c")


@dataclass(frozen=True)
class RowWeights:
    """A layer's weight as the kernel reads it: int8 [out, in], a scale and the sum of each output row."""

    weight: torch.Tensor
    scale: torch.Tensor
    row_sums: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor, scale: torch.Tensor) -> RowWeights:
        """From the int8 weight [out, in] and its float per-output-channel scales."""
        return cls(weight.contiguous(), scale.float().contiguous(), weight.sum(dim=1, dtype=torch.int32).contiguous())


class Int8Gemv:
    """Calls `int8_gemv` on torch tensors: one float32 row times a `RowWeights`."""

    def __init__(self, library: Path, loaded: ctypes.CDLL) -> None:
        self.library = library
        function = loaded.int8_gemv
        function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_int]
        function.restype = ctypes.c_int
        self._function = function

    def __call__(self, row: torch.Tensor, weights: RowWeights) -> torch.Tensor:
        """`row` [1, in] (float32, CPU) times the weight: [1, out] in float32."""
        out_features, in_features = weights.weight.shape
        if row.shape != (1, in_features) or row.dtype != torch.float32 or row.device.type != "cpu":
            raise ValueError(f"int8 gemv: a float32 CPU row of {in_features} features, not {tuple(row.shape)} {row.dtype}")
        row = row.contiguous()
        out = row.new_empty(1, out_features)
        status = self._function(
            row.data_ptr(), weights.weight.data_ptr(), weights.scale.data_ptr(), weights.row_sums.data_ptr(),
            out.data_ptr(), in_features, out_features, torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("int8 gemv: could not allocate the row's int8 copy")
        return out


def load_int8_gemv(cache_dir: Path) -> Int8Gemv | None:
    """The kernel, or None (fbgemm for every step) where it cannot be built here."""
    try:
        kernel = Int8Gemv(*build_library(SOURCE, cache_dir))
    except KernelBuildError as error:
        logger.warning("int8 layers run fbgemm at one row too: %s", error)
        return None
    logger.info("int8 layers at one row: %s", kernel.library.name)
    return kernel
