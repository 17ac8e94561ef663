"""Linear layers served from a GGUF's own blocks (`quantization: gguf`): each weight stays as the file stores it
(Q4_1 or Q8_0 codes, `kernels/gguf_matmul.py`), and activations stay float32.

A step of few rows multiplies straight from the codes: a token reads a fifth of the float32 weight's bytes.
A step of many rows widens the weight back to float32, a slice of output channels at a time into a scratch
buffer, and multiplies on the BLAS as the float model does: the widened weight is bit for bit the float32 one
a model converted from the same file holds, so those steps compute what the float path computes. Where the
crossing lies differs by host, so a start times both on the model's own weights (`choose_kernel_rows`).

The product is a custom op (`serve_app::gguf_linear`) over a registry of the weights, taking the weight's id as
a 0-d tensor, so that every decoder layer runs one compiled graph (as with oneDNN's packed weights)."""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import weakref
from dataclasses import dataclass

import torch

from serve_app.model.kernels.gguf_matmul import BlockWeight, GgufMatmul
from serve_app.model.kernels.timing import fastest

logger = logging.getLogger(__name__)

_WEIGHTS: dict[int, BlockWeight] = {}  # weight id -> its blocks
_ids = itertools.count()
_SCRATCH_BYTES = 16 * 2**20  # the widest slice of a weight widened at once (a layer's whole weight, an LM head's part)
_scratch = threading.local()  # each thread's float32 scratch buffer (engines in one process may step at once)


@dataclass
class _Product:
    """The kernel every layer calls, and up to how many rows a product runs on it (beyond: widened, the BLAS)."""

    kernel: GgufMatmul | None = None
    kernel_rows: int = 1


_PRODUCT = _Product()


def use_kernel(kernel: GgufMatmul, kernel_rows: int) -> None:
    """Run every block layer's products on `kernel`, straight from the codes up to `kernel_rows` rows."""
    _PRODUCT.kernel, _PRODUCT.kernel_rows = kernel, kernel_rows


def _widened_product(rows: torch.Tensor, weight: BlockWeight, kernel: GgufMatmul) -> torch.Tensor:
    """`rows` times the weight widened to float32 a slice of channels at a time, on `F.linear`."""
    step = max(4, _SCRATCH_BYTES // (4 * weight.in_features) // 4 * 4)
    buffer = getattr(_scratch, "buffer", None)
    needed = min(step, weight.out_features) * weight.in_features
    if buffer is None or buffer.numel() < needed:
        buffer = _scratch.buffer = torch.empty(max(needed, _SCRATCH_BYTES // 4))
    if weight.out_features <= step:
        widened = kernel.dequantize(weight, 0, buffer[:needed].view(weight.out_features, weight.in_features))
        return torch.nn.functional.linear(rows, widened)
    out = rows.new_empty(rows.shape[0], weight.out_features)
    for first in range(0, weight.out_features, step):
        count = min(step, weight.out_features - first)
        widened = kernel.dequantize(weight, first, buffer[: count * weight.in_features].view(count, weight.in_features))
        out[:, first : first + count] = torch.nn.functional.linear(rows, widened)
    return out


@torch.library.custom_op("serve_app::gguf_linear", mutates_args=())
def gguf_linear(rows: torch.Tensor, weight_id: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """`rows` [M, in] times the block weight `weight_id` (plus `bias`): [M, out]."""
    weight, kernel = _WEIGHTS[int(weight_id)], _PRODUCT.kernel
    if kernel is None:
        raise RuntimeError("gguf linear: no kernel loaded (use_kernel)")
    out = kernel.matmul(rows, weight) if rows.shape[0] <= _PRODUCT.kernel_rows else _widened_product(rows, weight, kernel)
    return out if bias is None else out + bias


@gguf_linear.register_fake
def _(rows: torch.Tensor, weight_id: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], out_features)


class GgufLinear(torch.nn.Module):
    """A linear layer whose weight is a GGUF's blocks, on float32 activations."""

    def __init__(self, weight: BlockWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.weight_id = next(_ids)
        self.register_buffer("weight_index", torch.tensor(self.weight_id), persistent=False)
        _WEIGHTS[self.weight_id] = weight
        weakref.finalize(self, _WEIGHTS.pop, self.weight_id, None)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = gguf_linear(x.reshape(-1, self.in_features), self.weight_index, self.bias, self.out_features)
        return out.reshape(*x.shape[:-1], self.out_features)


_ROW_CLASSES = (2, 4, 8, 16, 32, 64)  # rows at which the two ways are timed
_TIMED_CALLS = 5  # of each product, the fastest kept


@torch.inference_mode()
def choose_kernel_rows(kernel: GgufMatmul, layer_weights: list[BlockWeight], n_layers: int, head: BlockWeight | None) -> int:
    """Up to how many rows the codes' kernel beats widening and the BLAS on this host: a token's products (one
    decoder layer's weights counted `n_layers` times, and the LM `head`) timed both ways at each of
    `_ROW_CLASSES`, the fastest of `_TIMED_CALLS` each, interleaved; the largest row count where the kernel
    wins (one row always: there it reads a fifth of the bytes, which a warm timing does not show)."""
    weights = [(weight, n_layers) for weight in layer_weights] + ([(head, 1)] if head is not None else [])
    chosen = 1
    timings = []
    for rows in _ROW_CLASSES:
        totals = {"kernel": 0.0, "widened": 0.0}
        for weight, count in weights:
            x = torch.randn(rows, weight.in_features)
            products = {
                "kernel": functools.partial(kernel.matmul, x, weight),
                "widened": functools.partial(_widened_product, x, weight, kernel),
            }
            best = fastest(products, _TIMED_CALLS)
            for name in totals:
                totals[name] += best[name] * count
        timings.append(f"{rows} rows {totals['kernel'] * 1e3:.1f} ms codes, {totals['widened'] * 1e3:.1f} ms widened")
        if totals["kernel"] >= totals["widened"]:
            break
        chosen = rows
    logger.info("a token's block products on this host: %s: the codes' kernel up to %d rows", "; ".join(timings), chosen)
    return chosen
