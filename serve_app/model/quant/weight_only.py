"""Weight-only int8 and fp8 through torchao: every `nn.Linear` of a loaded model (the attention and
MLP projections and the LM head) keeps its weight quantized, int8 or fp8 (e4m3) with a scale per
output channel, and multiplies the activations in the model's own dtype. What `quantization: int8`
runs off the CPU (where torch's int8 product is CPU-only) and what `quantization: fp8` runs."""

from __future__ import annotations

from typing import Literal

import torch

WeightOnlyKind = Literal["int8", "fp8"]

# torchao's fp8 row scale is the row's largest magnitude over 448: an all-zero row (a padding token's
# LM head row, say) would get a scale of 0 and NaN logits, so the largest magnitude is at least this.
FP8_MAGNITUDE_FLOOR = 1e-12


def quantize_weight_only(model: torch.nn.Module, kind: WeightOnlyKind) -> torch.nn.Module:
    """`model` with every linear layer's weight a torchao quantized tensor (in place)."""
    from torchao.quantization import (
        Float8Tensor,
        Int8WeightOnlyConfig,
        PerRow,
        quantize_,
    )

    def is_linear(module: torch.nn.Module) -> bool:
        return type(module) is torch.nn.Linear

    if kind == "int8":
        # torchao's recommended inductor settings are process-wide; the compiled forward keeps its own.
        quantize_(model, Int8WeightOnlyConfig(set_inductor_config=False), filter_fn=lambda m, _: is_linear(m))
        return model
    for linear in filter(is_linear, list(model.modules())):
        weight = Float8Tensor.from_hp(linear.weight.detach(), granularity=PerRow(), hp_value_lb=FP8_MAGNITUDE_FLOOR)
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    return model
