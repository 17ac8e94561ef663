"""transformers' reference generation, cached per prompt, for the greedy-equality oracle."""

from __future__ import annotations

from pathlib import Path

import torch


class ReferenceModel:
    """`model.generate(do_sample=False)` with transformers' own attention and cache."""

    def __init__(self, path: Path, adapter: Path | None = None) -> None:
        """The model at `path`, with the LoRA adapter at `adapter` (through peft) where given."""
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        if adapter is not None:
            from peft import PeftModel

            self.model = PeftModel.from_pretrained(self.model, adapter)
        self.model.eval()
        self._cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """The greedy continuation of `prompt_ids`, ignoring end-of-sequence (always `max_new_tokens`)."""
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self._cache:
            with torch.inference_mode():
                out = self.model.generate(
                    torch.tensor([prompt_ids]),
                    attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            self._cache[key] = out[0, len(prompt_ids) :].tolist()
        return self._cache[key]

    def kv(self, prompt_ids: list[int]) -> torch.Tensor:
        """transformers' KV for `prompt_ids` as `[2, n_layers, T, n_kv_heads * head_dim]` (post-RoPE k)."""
        with torch.inference_mode():
            out = self.model(torch.tensor([prompt_ids]), use_cache=True)
        layers = out.past_key_values.layers
        # Each layer holds [1, n_kv_heads, T, head_dim]; tokens first, heads flattened.
        keys = torch.stack([layer.keys[0].transpose(0, 1).flatten(1) for layer in layers])
        values = torch.stack([layer.values[0].transpose(0, 1).flatten(1) for layer in layers])
        return torch.stack([keys, values])
