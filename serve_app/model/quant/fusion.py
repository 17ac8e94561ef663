"""Fused projections: a gated MLP's gate and up projections (`down(act(gate(x)) * up(x))`, as the
Llama, Qwen2, Qwen3 and Mistral MLPs compute it) become one linear layer of both weights, one matrix
product where there were two. With int8 weights, where a product of one row costs little next to the call
itself, this measured faster at one client; in fp32 it measured within noise, so only int8 uses it."""

from __future__ import annotations

import torch

from serve_app.model.surgery import replace_modules

# The MLP classes whose forward is `down_proj(act_fn(gate_proj(x)) * up_proj(x))`.
GATED_MLPS = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"})


class GateUpMLP(torch.nn.Module):
    """`down(act(gate(x)) * up(x))` with gate and up one product, split after."""

    def __init__(self, gate: torch.nn.Linear, up: torch.nn.Linear, down: torch.nn.Module, act: torch.nn.Module) -> None:
        super().__init__()
        self.intermediate = gate.out_features
        # Made on the meta device (nothing allocated or initialized), then given the two layers' weights.
        self.gate_up = torch.nn.Linear(gate.in_features, 2 * self.intermediate, bias=gate.bias is not None, device="meta")
        self.gate_up.weight = torch.nn.Parameter(torch.cat([gate.weight, up.weight]), requires_grad=False)
        if gate.bias is not None:
            self.gate_up.bias = torch.nn.Parameter(torch.cat([gate.bias, up.bias]), requires_grad=False)
        self.down_proj = down
        self.act_fn = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def _is_gated_mlp(module: torch.nn.Module) -> bool:
    gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
    return (
        type(module).__name__ in GATED_MLPS
        and isinstance(gate, torch.nn.Linear) and isinstance(up, torch.nn.Linear)
        and gate.weight.shape == up.weight.shape and (gate.bias is None) == (up.bias is None)
    )


def fuse_gate_up(model: torch.nn.Module) -> int:
    """Replace every gated MLP of `model` by a `GateUpMLP` of the same weights (in place); how many."""
    return replace_modules(
        model,
        lambda _, child: GateUpMLP(child.gate_proj, child.up_proj, child.down_proj, child.act_fn) if _is_gated_mlp(child) else None,
    )
