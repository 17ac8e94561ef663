"""The model's tokenizer and chat template, behind one small class the engine and protocols share."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from serve_app.errors import InvalidRequestError

ChatMessage = dict[str, Any]


class Tokenizer:
    """Wraps a Hugging Face tokenizer: plain encoding, the chat template, decoding, end-of-sequence ids."""

    def __init__(self, path: Path, extra_eos_token_ids: Sequence[int] = ()) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(path)
        eos = {int(i) for i in extra_eos_token_ids}
        if self.hf.eos_token_id is not None:
            eos.add(int(self.hf.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size: int = len(self.hf)

    def encode(self, text: str) -> list[int]:
        """The ids the engine uses for a string prompt (with the tokenizer's own special tokens)."""
        return list(self.hf.encode(text))

    def apply_chat_template(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        if not self.hf.chat_template:
            raise InvalidRequestError("messages", "this model has no chat template; send a plain prompt instead")
        return self.hf.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        """Chat messages -> prompt ids through the template (which already holds the special tokens)."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
