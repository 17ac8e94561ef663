"""A loaded model's weights as `quantization` asks: `none` leaves them; `int8` on the CPU is int8
weights with dynamic int8 activations on torch's fbgemm product, and at one row on the engine's own
kernel built into `kernel_dir` (`quantize.py`, a gated MLP's gate and up projections fused first,
`fusion.py`), off the CPU int8 weights only (`weight_only.py`);
`int4` on the CPU is 4-bit weights in groups of 32 (`int4.py`), taken as stored from the model's GGUF where
its layers are Q4_1 blocks (`gguf_blocks.py`), else quantized at load;
`fp8` is fp8 weights only on any device (torchao's kernels are CUDA's; on the CPU each step
dequantizes every weight, many times slower than float32)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from serve_app.config import Quantization
from serve_app.model.kernels.int8_gemv import load_int8_gemv
from serve_app.model.quant.fusion import fuse_gate_up
from serve_app.model.quant.gguf_blocks import Q4_1Weights
from serve_app.model.quant.int4 import quantize_int4
from serve_app.model.quant.quantize import quantize_int8
from serve_app.model.quant.weight_only import quantize_weight_only

logger = logging.getLogger(__name__)


def apply_quantization(
    model: torch.nn.Module, quantization: Quantization, device: torch.device, kernel_dir: Path, gguf: Path | None = None
) -> torch.nn.Module:
    """`model` (already on `device`) with its linear layers quantized as `quantization` says; `gguf`: the file
    the model was made from, if any."""
    if quantization == "none":
        return model
    if quantization == "int4":
        if device.type != "cpu":
            raise ValueError(f"quantization: int4 runs on the CPU (torch's CPU kernel for 4-bit weights), not {device}")
        quantize_int4(model, Q4_1Weights(gguf).get if gguf is not None else lambda _: None)
        return model
    if quantization == "int8" and device.type == "cpu":
        fuse_gate_up(model)  # one int8 product for gate and up
        return quantize_int8(model, load_int8_gemv(kernel_dir))
    if device.type == "cpu":
        logger.warning("quantization: fp8 on the CPU dequantizes every weight at every step, many times slower "
                       "than float32; int8 is the CPU's fast path")
    return quantize_weight_only(model, quantization)

