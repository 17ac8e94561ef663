"""fp32 linear layers on oneDNN for the compiled forward on the CPU, where they pay on this host: every
`nn.Linear` of the model (the projections and the LM head) replaced by `OneDnnLinear`, its weight converted
once to a oneDNN tensor, each product `torch.ops.mkldnn._linear_pointwise`, what inductor's weight freezing
would have made of it. Whether that beats `F.linear` differs by host, so a start times both on the model's
own weights (`time_layouts`) and packs only where oneDNN wins (docs/compile.md).

The product is a custom op (`serve_app::onednn_linear`) over a registry of the packed weights, taking
the weight's id as a 0-d tensor, so that every decoder layer runs one compiled graph, as with int8. The
eager forward keeps `F.linear`, whose tokens the greedy oracle holds equal to transformers': oneDNN
sums in another order, so logits differ in the last bits.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from dataclasses import dataclass

import torch

from serve_app.model.kernels.timing import fastest
from serve_app.model.surgery import replace_modules

_PACKED: dict[int, torch.Tensor] = {}  # weight id -> the weight in oneDNN's layout
_ids = itertools.count()


@torch.library.custom_op("serve_app::onednn_linear", mutates_args=())
def onednn_linear(rows: torch.Tensor, weight_id: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """`rows` [M, in] times the packed weight `weight_id` (plus `bias`): [M, out]."""
    return torch.ops.mkldnn._linear_pointwise(rows, _PACKED[int(weight_id)], bias, "none", [], "")


@onednn_linear.register_fake
def _(rows: torch.Tensor, weight_id: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], out_features)


class OneDnnLinear(torch.nn.Module):
    """An fp32 `nn.Linear` whose weight lives in oneDNN's layout only."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.weight_id = next(_ids)
        self.register_buffer("weight_index", torch.tensor(self.weight_id), persistent=False)
        _PACKED[self.weight_id] = linear.weight.detach().to_mkldnn()
        weakref.finalize(self, _PACKED.pop, self.weight_id, None)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)

    def dense(self) -> torch.nn.Linear:
        """This layer as an `nn.Linear` again, its weight back in the plain layout."""
        linear = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = torch.nn.Parameter(_PACKED[self.weight_id].to_dense(), requires_grad=False)
        linear.bias = self.bias
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = onednn_linear(x.reshape(-1, self.in_features), self.weight_index, self.bias, self.out_features)
        return out.reshape(*x.shape[:-1], self.out_features)


def onednn_supported(device: torch.device) -> bool:
    """Whether linears can run on oneDNN here: a CPU, and torch built with oneDNN (`pack_linears` takes the
    fp32 ones)."""
    return device.type == "cpu" and torch.backends.mkldnn.is_available()


@dataclass(frozen=True)
class LayoutTiming:
    """A token's linear products timed on this host in each layout, at one row (one client's decode) and
    at `BATCH_ROWS` rows (a full batch): seconds for the model's layers' products and its LM head's."""

    aten_one_row: float
    onednn_one_row: float
    aten_batch: float
    onednn_batch: float

    @property
    def onednn_pays(self) -> bool:
        """Whether oneDNN's layout wins overall: its two ratios to `F.linear`'s multiply to less than 1 (so a
        large loss at one row is not bought by a small gain at a batch, nor the other way round)."""
        return (self.onednn_one_row / self.aten_one_row) * (self.onednn_batch / self.aten_batch) < 1.0


BATCH_ROWS = 64
_TIMED_CALLS = 5  # of each product, the fastest kept


@torch.inference_mode()
def time_layouts(layer_linears: list[torch.nn.Linear], n_layers: int, head: torch.nn.Linear | None) -> LayoutTiming:
    """A token's products with `F.linear` (MKL's sgemm through aten) and with oneDNN's `_linear_pointwise` on
    the same weights: one decoder layer's `layer_linears` counted `n_layers` times, and the LM `head`, at one
    row and at `BATCH_ROWS`; each product's fastest of `_TIMED_CALLS`, the layouts interleaved. Which wins
    differs by host: on one 2-core AVX-512 host oneDNN ran a 64-row batch 1.7x faster, on another it ran
    one row 1.4x slower and a batch no faster (docs/compile.md)."""
    weights = [(linear.weight.detach(), n_layers) for linear in layer_linears]
    if head is not None:
        weights.append((head.weight.detach(), 1))
    seconds = {}
    for rows in (1, BATCH_ROWS):
        totals = {"aten": 0.0, "onednn": 0.0}
        for weight, count in weights:
            x = torch.randn(rows, weight.shape[1])
            products = {
                "aten": functools.partial(torch.nn.functional.linear, x, weight),
                "onednn": functools.partial(torch.ops.mkldnn._linear_pointwise, x, weight.to_mkldnn(), None, "none", [], ""),
            }
            best = fastest(products, _TIMED_CALLS)
            for name in totals:
                totals[name] += best[name] * count
        seconds[rows] = totals
    return LayoutTiming(
        seconds[1]["aten"], seconds[1]["onednn"], seconds[BATCH_ROWS]["aten"], seconds[BATCH_ROWS]["onednn"]
    )


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every fp32 `nn.Linear` of `model` by a `OneDnnLinear` (in place); how many."""
    return replace_modules(
        model,
        lambda _, child: OneDnnLinear(child) if type(child) is torch.nn.Linear and child.weight.dtype == torch.float32 else None,
    )


def restore_linears(model: torch.nn.Module) -> None:
    """Undo `pack_linears`: every `OneDnnLinear` back to the `nn.Linear` it replaced."""
    replace_modules(model, lambda _, child: child.dense() if isinstance(child, OneDnnLinear) else None)
