"""LoRA adapters made with peft for the tests: small rank, random non-zero `B`, so outputs differ from the base."""

from __future__ import annotations

from pathlib import Path

import torch


def build_adapter(
    base: Path, folder: Path, seed: int, rank: int = 4, targets: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "down_proj")
) -> Path:
    """Write a PEFT LoRA adapter of the model at `base` into `folder` and return it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.mul_(0.5)  # random A and B: a clear but not wild change of the outputs
    peft_model.save_pretrained(folder)
    return folder
