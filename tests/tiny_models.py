"""Tiny randomly initialised models (Llama, Qwen3 and Gemma2 shapes) with the real tokenizer, for fast tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def build_tiny_model(
    kind: str, folder: Path, tokenizer_from: Path, seed: int = 0, chat_template: Path | None = None, **config_fields: object
) -> Path:
    """Write a 2-layer model of `kind` ('llama', 'qwen3' or 'gemma2') into `folder` and return it; `chat_template`
    replaces the tokenizer's template, `config_fields` set more of its config."""
    from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, Qwen3Config

    common: dict[str, object] = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    common.update(config_fields)
    config = {"qwen3": Qwen3Config, "llama": LlamaConfig, "gemma2": Gemma2Config}[kind](**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    for name in _TOKENIZER_FILES:
        source = tokenizer_from / name
        if source.is_file():
            shutil.copy(source, folder / name)
    if chat_template is not None:
        shutil.copy(chat_template, folder / "chat_template.jinja")
    return folder


def tokenizer_with_tokens(model_path: Path, folder: Path, tokens: list[str], special: bool) -> Path:
    """The embedded model's tokenizer with `tokens` added after its vocabulary (special ones are left out of text
    unless kept), saved in `folder`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.add_tokens(tokens, special_tokens=special)
    tokenizer.save_pretrained(folder)
    return folder
