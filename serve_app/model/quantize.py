"""int8 weights: every `nn.Linear` of a loaded model (the attention and MLP projections and the LM
head) replaced by `Int8Linear`: weights quantized to int8 once at load, per output channel, and
activations quantized per step, per token (row), so that one token's outliers set no other token's
scale in a packed batch; the product runs on torch's int8 matrix multiply (`torch._int_mm`) and is
rescaled to float. CPU only: on CUDA this needs `torchao`, which the project does not install."""

from __future__ import annotations

import torch

INT8_MAX = 127.0


class Int8Linear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        scale = weight.abs().amax(dim=1).clamp(min=1e-8) / INT8_MAX
        self.out_features, self.in_features = weight.shape
        quantized = (weight / scale[:, None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        self.register_buffer("weight_t", quantized.t().contiguous())  # [in, out], as the product takes it
        self.register_buffer("weight_scale", scale)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / INT8_MAX
        quantized = (rows / scale).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        out = torch._int_mm(quantized, self.weight_t).float().mul_(scale).mul_(self.weight_scale)
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def quantize_int8(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model` with every linear layer an `Int8Linear` (in place)."""
    if device.type != "cpu":
        raise ValueError(f"quantization: int8 runs on CPU; {device} would need torchao's int8 kernels")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, Int8Linear(child))
    return model
