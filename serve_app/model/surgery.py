"""Swapping a model's submodules in place: the one walk that int8 quantization, the fused MLP, LoRA
and the oneDNN linears use to put their layers where the model's were."""

from __future__ import annotations

from collections.abc import Callable

import torch


def replace_modules(model: torch.nn.Module, make: Callable[[str, torch.nn.Module], torch.nn.Module | None]) -> int:
    """Offer every submodule of `model` (its dotted path, itself) to `make`, and put what `make` returns in
    its place; how many were replaced. What is put in place is not offered again."""
    replaced = 0
    for path, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            new = make(f"{path}.{name}" if path else name, child)
            if new is not None:
                setattr(parent, name, new)
                replaced += 1
    return replaced
