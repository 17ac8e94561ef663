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

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        prefix_text, new_text = self._window()
        if len(new_text) <= len(prefix_text) or new_text.endswith(_INCOMPLETE):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def skip(self, token_id: int) -> str:
        """Add a token whose text is not wanted (a marker); return what was held before it, whole."""
        held = self.flush()
        self._ids.append(token_id)
        self._prefix_offset = self._read_offset = len(self._ids)
        return held

    def flush(self) -> str:
        """Whatever is still held at the end of generation (an incomplete character decodes as U+FFFD)."""
        prefix_text, new_text = self._window()
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""

    def _window(self) -> tuple[str, str]:
        """The text of the window before the unread tokens, and with them."""
        decode, skip = self._tokenizer.decode, self._skip_special
        start = self._prefix_offset
        return decode(self._ids[start : self._read_offset], skip), decode(self._ids[start:], skip)
