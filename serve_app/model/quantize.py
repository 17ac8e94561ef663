"""int8 weights: every `nn.Linear` of a loaded model (the attention and MLP projections and the LM
head) replaced by `Int8Linear`: weights quantized to int8 once at load, per output channel, and
activations quantized at each step per token (row), so that one token's outliers set no other
token's scale in a packed batch. CPU only: on CUDA this needs `torchao`, which the project does
not install.

Two products, chosen per layer by its shape (each was the faster one there, measured on this
model's layers): torch's int8 matrix multiply (`torch._int_mm`) for the projections, and torch's
own dynamically quantized linear (fbgemm, weights prepacked) for a layer as wide as an LM head,
where `_int_mm` is slow on the few rows a decode step samples (4x at one row, 1.6x at 64). fbgemm
quantizes a whole batch at one scale, so each row is first divided by its own (its largest
magnitude over 127), which leaves every row spanning the same int8 range, and the product is
multiplied back by it. The fbgemm product is a custom op (`serve_app::int8_linear`) over a
registry of the prepacked weights, so that `torch.compile` treats it as one opaque call, as it
does the attention."""

from __future__ import annotations

import itertools
import warnings
import weakref

import torch

INT8_MAX = 127.0
# A layer with more outputs than this is an LM head: its product runs on fbgemm.
WIDE_LAYER = 8192

_PACKED: dict[int, tuple[torch.ScriptObject, int]] = {}  # weight id -> (prepacked weight, out features)
_ids = itertools.count()


@torch.library.custom_op("serve_app::int8_linear", mutates_args=())
def int8_linear(rows: torch.Tensor, weight_id: int) -> torch.Tensor:
    """`rows` [M, in] (fp32) times the prepacked int8 weight `weight_id`: [M, out] in fp32."""
    return torch.ops.quantized.linear_dynamic(rows, _PACKED[weight_id][0], False)  # the full 8 bits


@int8_linear.register_fake
def _(rows: torch.Tensor, weight_id: int) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], _PACKED[weight_id][1])


class Int8Linear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        self.out_features, self.in_features = weight.shape
        scale = weight.abs().amax(dim=1).clamp(min=1e-8) / INT8_MAX
        self.weight_id: int | None = None
        if self.out_features > WIDE_LAYER:
            self.weight_id = _prepack(weight, scale)
            weakref.finalize(self, _PACKED.pop, self.weight_id, None)
        else:
            quantized = (weight / scale[:, None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
            self.register_buffer("weight_t", quantized.t().contiguous())  # [in, out], as the product takes it
            self.register_buffer("weight_scale", scale)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / INT8_MAX
        if self.weight_id is not None:
            out = int8_linear(rows / scale, self.weight_id).mul_(scale)
        else:
            quantized = (rows / scale).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
            out = torch._int_mm(quantized, self.weight_t).float().mul_(scale).mul_(self.weight_scale)
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def _prepack(weight: torch.Tensor, scale: torch.Tensor) -> int:
    """Prepack `weight` [out, in] quantized at `scale` per output channel for fbgemm; its registry id."""
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # fbgemm's prepacking takes torch's quantized tensor type, deprecated
        warnings.simplefilter("ignore", UserWarning)
        quantized = torch.quantize_per_channel(weight, scale.double(), zero_points, 0, torch.qint8)
    weight_id = next(_ids)
    _PACKED[weight_id] = (torch.ops.quantized.linear_prepack(quantized, None), weight.shape[0])
    return weight_id


def quantize_int8(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model` with every linear layer an `Int8Linear` (in place)."""
    if device.type != "cpu":
        raise ValueError(f"quantization: int8 runs on CPU; {device} would need torchao's int8 kernels")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, Int8Linear(child))
    return model
