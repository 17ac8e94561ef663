"""Incremental detokenization: text deltas from token ids, never splitting a multi-byte character."""

from __future__ import annotations

from collections.abc import Sequence

from serve_app.model.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a growing token list a window at a time, holding text until its characters are whole.

    Decoding a window that starts a few tokens back (`prefix_offset`) keeps the spacing that
    tokenizers attach to neighbouring tokens; text ending in U+FFFD is an incomplete UTF-8
    sequence and waits for the next token.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_INCOMPLETE):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held at the end of generation (an incomplete character decodes as U+FFFD)."""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
