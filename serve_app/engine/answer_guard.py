"""AnswerGuard: what the engine holds a structured answer to beyond its grammar, token by token.

- A tool call identical to one already made in the same answer ends the answer (`stop`): a small
  model that repeats its call stops after the first, not at `max_tokens`.
- A JSON string of the answer that has run for `max_string_tokens` tokens is closed: its next token is
  the closing quote, where the grammar allows the string to end there.
- The answer's tokens inside its constrained JSON (the calls, or a JSON answer) stop at
  `max_constrained_tokens` (`length`).
"""

from __future__ import annotations

from typing import Literal

from serve_app.answers.reader import AnswerReader
from serve_app.model.detokenizer import IncrementalDetokenizer
from serve_app.wire.outputs import TokenRole


class AnswerGuard:
    """Reads the answer's text as the core chooses its tokens (its own detokenizer: the forced quote is a token
    choice, so it is made where tokens are chosen)."""

    def __init__(
        self,
        reader: AnswerReader,
        detokenizer: IncrementalDetokenizer,
        quote_token: int | None,
        max_string_tokens: int | None = None,
        max_constrained_tokens: int | None = None,
    ) -> None:
        self.reader = reader
        self.detokenizer = detokenizer
        self.quote_token = quote_token  # the token that is exactly `"`, for closing a string
        self.max_string_tokens = max_string_tokens
        self.max_constrained_tokens = max_constrained_tokens
        self._string: tuple[int, int] | None = None  # the string now open, and how many tokens it has run
        self._string_tokens = 0
        self._constrained_tokens = 0

    def read(self, token: int, role: TokenRole, was_thinking: bool) -> Literal["stop", "length"] | None:
        """Read one accepted token (a marker's token adds no text; the thinking's text is not the answer's); why the
        answer ends with it, if it does."""
        text = self.detokenizer.skip(token) if role == "tag" else self.detokenizer.push(token)
        if role == "thinking" or (role == "tag" and was_thinking):
            return None
        return self.after(text)

    def after(self, text: str) -> Literal["stop", "length"] | None:
        """Read one accepted token's text; why the answer ends with it, if it does."""
        constrained_before = self.reader.constrained
        self.reader.feed(text)
        if self.reader.repeated:
            return "stop"
        if constrained_before or self.reader.constrained:
            self._constrained_tokens += 1
            if self.max_constrained_tokens is not None and self._constrained_tokens >= self.max_constrained_tokens:
                return "length"
        string = self.reader.open_string
        self._string_tokens = 0 if string is None else self._string_tokens + 1 if string == self._string else 1
        self._string = string
        return None

    @property
    def forced_token(self) -> int | None:
        """The token the next step must take where the grammar allows it: the closing quote of a string
        that has run for `max_string_tokens`."""
        if self.max_string_tokens is None or self._string_tokens < self.max_string_tokens:
            return None
        return self.quote_token if self.reader.string_may_close else None
