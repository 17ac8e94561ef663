"""int8 weights: every `nn.Linear` of a loaded model (the attention and MLP projections and the LM
head) replaced by `Int8Linear`: weights quantized to int8 once at load, per output channel, and
prepacked for torch's own dynamically quantized linear (fbgemm), which quantizes the activations
at each step. So that one token's outliers set no other token's scale in a packed batch, each row
is first divided by its own scale (its largest magnitude over 127), which leaves every row spanning
the same int8 range, and the product is multiplied back by it. Where the CPU lacks AVX-512 VNNI,
fbgemm adds pairs of u8 x s8 products in saturating 16-bit lanes (`vpmaddubsw`), and 8-bit weights
overflow them (a random layer's outputs came out up to a third of their range off): there the weights
take 7 bits (-63..63). torch's own fbgemm configs take the bit from the activations instead
(`reduce_range`), which costs more on SmolLM2, whose activations have outlier channels: on a Zen 1
host `bench quant` gave fp32's next token at 0.842 of positions with 8-bit weights (saturating), 0.828
with 7-bit activations, 0.898 with 7-bit weights. CPU only (fbgemm): off the CPU, `quantization: int8`
is int8 weights alone, through torchao (`weight_only.py`).

A step of one row (one sequence decoding) runs the layers on `int8_gemv.c` instead, where the
kernel builds: the row quantized at its own scale, the int8 weights read once, without fbgemm's
fixed cost per call, which at one row is most of a layer's time. It keeps its own copy of the int8
weights (unpacked), so int8 holds its weights twice on the CPU.

Both products are custom ops (`serve_app::int8_linear`, `serve_app::int8_gemv`) over registries of
the layers' weights, so that `torch.compile` treats each as one opaque call, as it does the
attention."""

from __future__ import annotations

import itertools
import warnings
import weakref

import torch

from serve_app.model.kernels.int8_gemv import Int8Gemv, RowWeights
from serve_app.model.surgery import replace_modules

INT8_MAX = 127.0
# The weights' largest magnitude: 7 bits where fbgemm's saturating pair sums need it (no VNNI), else 8.
WEIGHT_MAX = 127.0 if torch.cpu.get_capabilities().get("avx512_vnni", False) else 63.0

_PACKED: dict[int, torch.ScriptObject] = {}  # weight id -> prepacked weight
_ROWS: dict[int, tuple[Int8Gemv, RowWeights]] = {}  # weight id -> (one-row kernel, its weights)
_ids = itertools.count()


# The ops take the weight's id as a 0-d tensor (each layer's `weight_index` buffer), so that every decoder
# layer runs the same compiled graph; the output width is a plain int, the same at one place in every layer.


@torch.library.custom_op("serve_app::int8_linear", mutates_args=())
def int8_linear(rows: torch.Tensor, weight_id: torch.Tensor, out_features: int) -> torch.Tensor:
    """`rows` [M, in] (fp32) times the prepacked int8 weight `weight_id`: [M, out] in fp32."""
    return torch.ops.quantized.linear_dynamic(rows, _PACKED[int(weight_id)], False)


@int8_linear.register_fake
def _(rows: torch.Tensor, weight_id: torch.Tensor, out_features: int) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], out_features)


@torch.library.custom_op("serve_app::int8_gemv", mutates_args=())
def int8_gemv(row: torch.Tensor, weight_id: torch.Tensor, out_features: int) -> torch.Tensor:
    """`row` [1, in] (fp32) times the int8 weight `weight_id` on the one-row kernel: [1, out] in fp32."""
    kernel, weights = _ROWS[int(weight_id)]
    return kernel(row, weights)


@int8_gemv.register_fake
def _(row: torch.Tensor, weight_id: torch.Tensor, out_features: int) -> torch.Tensor:
    return row.new_empty(1, out_features)


class Int8Linear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear, gemv: Int8Gemv | None = None) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        self.out_features, self.in_features = weight.shape
        scale = weight.abs().amax(dim=1).clamp(min=1e-8) / WEIGHT_MAX
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # fbgemm's prepacking takes torch's quantized tensor type, deprecated
            warnings.simplefilter("ignore", UserWarning)
            quantized = torch.quantize_per_channel(weight, scale.double(), zero_points, 0, torch.qint8)
        self.weight_id = next(_ids)
        self.register_buffer("weight_index", torch.tensor(self.weight_id), persistent=False)
        _PACKED[self.weight_id] = torch.ops.quantized.linear_prepack(quantized, None)
        weakref.finalize(self, _PACKED.pop, self.weight_id, None)
        self.one_row_kernel = gemv is not None
        if gemv is not None:
            _ROWS[self.weight_id] = (gemv, RowWeights.of(quantized.int_repr(), scale))
            weakref.finalize(self, _ROWS.pop, self.weight_id, None)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        if rows.shape[0] == 1 and self.one_row_kernel:
            out = int8_gemv(rows, self.weight_index, self.out_features)
        else:
            scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / INT8_MAX
            out = int8_linear(rows / scale, self.weight_index, self.out_features).mul_(scale)
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def quantize_int8(model: torch.nn.Module, gemv: Int8Gemv | None = None) -> torch.nn.Module:
    """`model` (on the CPU) with every linear layer an `Int8Linear` (in place), running one-row steps
    on `gemv` where given."""
    replace_modules(model, lambda _, child: Int8Linear(child, gemv) if type(child) is torch.nn.Linear else None)
    return model
