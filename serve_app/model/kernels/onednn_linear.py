"""fp32 linear layers on oneDNN for the compiled forward on the CPU: every `nn.Linear` of the model
(the projections and the LM head) replaced by `OneDnnLinear`, its weight reordered once into oneDNN's
blocked layout, each product `torch.ops.mkldnn._linear_pointwise`, what inductor's weight freezing
would have made of it. On this model's shapes it measured 2-2.7x faster than `F.linear` at 64 rows
and about 3x for the LM head at one row (docs/compile.md).

The product is a custom op (`serve_app::onednn_linear`) over a registry of the packed weights, taking
the weight's id as a 0-d tensor, so that every decoder layer runs one compiled graph, as with int8. The
eager forward keeps `F.linear`, whose tokens the greedy oracle holds equal to transformers': oneDNN
sums in another order, so logits differ in the last bits.
"""

from __future__ import annotations

import itertools
import weakref

import torch

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


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every fp32 `nn.Linear` of `model` by a `OneDnnLinear` (in place); how many."""
    return replace_modules(
        model,
        lambda _, child: OneDnnLinear(child) if type(child) is torch.nn.Linear and child.weight.dtype == torch.float32 else None,
    )


def restore_linears(model: torch.nn.Module) -> None:
    """Undo `pack_linears`: every `OneDnnLinear` back to the `nn.Linear` it replaced."""
    replace_modules(model, lambda _, child: child.dense() if isinstance(child, OneDnnLinear) else None)
