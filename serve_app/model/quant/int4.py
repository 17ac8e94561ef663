"""4-bit weights (`quantization: int4`, the CPU): every linear layer's weight in groups of 32 along its
input, each group 4-bit codes with a scale and a minimum (`w = scale * code + minimum`, GGUF's Q4_1), on
torch's own CPU kernel for 4-bit weights (`aten._weight_int4pack_mm_for_cpu`). Its activations are
bfloat16: that is the kernel's vectorized path (in float32 it is scalar, some 30x slower), so the
layer casts its input to bfloat16 and its output back.

Where a GGUF's Q4_1 blocks give a layer's weight (`gguf_blocks.py`), they are taken as they are; any
other layer is quantized at load, each group spanning its own minimum to maximum. A layer whose shape the
kernel does not take (outputs not a multiple of 16, inputs not of 32) keeps its float weight."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from serve_app.model.surgery import replace_modules

GROUP_SIZE = 32
# The kernel reads a weight as `(code - 8) * scale + zero`, so a Q4_1 group's zero is its minimum plus 8 scales.
_CODE_MIDPOINT = 8
_LEVELS = 15  # codes 0..15
_ROWS_AT_A_TIME = 1024  # a multiple of the kernel's block of 64 rows


@dataclass(frozen=True)
class Int4Weight:
    """A [out, in] weight as 4-bit codes (0..15, one per element, uint8) and per group of `GROUP_SIZE`
    inputs a scale and a minimum ([out, in / GROUP_SIZE], float32): `w = scale * code + minimum`."""

    codes: torch.Tensor
    scales: torch.Tensor
    minimums: torch.Tensor

    @staticmethod
    def quantize(weight: torch.Tensor) -> Int4Weight:
        """`weight` [out, in] quantized per group, each group's codes spanning its minimum to its maximum (a
        block of rows at a time, so that a large layer's float temporaries stay small)."""
        parts = [_quantize_rows(rows) for rows in weight.detach().split(_ROWS_AT_A_TIME)]
        return Int4Weight(*(torch.cat(tensors) for tensors in zip(*parts)))

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the codes stand for."""
        out_features, in_features = self.codes.shape
        codes = self.codes.float().reshape(out_features, -1, GROUP_SIZE)
        return (codes * self.scales[..., None] + self.minimums[..., None]).reshape(out_features, in_features)


def _quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out_features, in_features = rows.shape
    groups = rows.float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    minimums, maximums = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((maximums - minimums) / _LEVELS).clamp(min=1e-10)
    codes = (groups - minimums[..., None]).div_(scales[..., None]).round_().clamp_(0, _LEVELS)
    return codes.reshape(out_features, in_features).to(torch.uint8), scales, minimums


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """The kernel's packed form of `codes`, a block of rows at a time (it packs rows in blocks of 64, so the
    blocks' packs laid one after another are the whole's)."""
    pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
    return torch.cat([pack(rows.int(), 1) for rows in codes.split(_ROWS_AT_A_TIME)])


def int4_supported(out_features: int, in_features: int) -> bool:
    """Whether the kernel takes a weight of this shape."""
    return out_features % 16 == 0 and in_features % GROUP_SIZE == 0


class Int4Linear(torch.nn.Module):
    """A linear layer of 4-bit weights: the kernel's packed codes and its bfloat16 scales and zeros."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.codes.shape
        self.register_buffer("packed", _pack(weight.codes))
        zeros = weight.minimums + _CODE_MIDPOINT * weight.scales
        # [in / GROUP_SIZE, out, 2], as the kernel reads them.
        scales_and_zeros = torch.stack([weight.scales, zeros], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16))
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP_SIZE, self.scales_and_zeros)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_int4(model: torch.nn.Module, given: Callable[[str], Int4Weight | None] = lambda _: None) -> int:
    """Make every linear layer of `model` (on the CPU) an `Int4Linear` in place, with the weight `given` for its
    module path where there is one, else quantized here; an LM head tied to the embedding gets its own. How many."""

    def replace(path: str, child: torch.nn.Module) -> Int4Linear | None:
        if type(child) is not torch.nn.Linear or not int4_supported(child.out_features, child.in_features):
            return None
        weight = given(path) or Int4Weight.quantize(child.weight)
        return Int4Linear(weight, child.bias)

    return replace_modules(model, replace)
