"""Thinking spans: where a reasoning model's thinking ends and its answer begins, token by token.

A reasoning model (Qwen3, DeepSeek-R1) writes `<think>` ... `</think>` before its answer; vLLM's
`reasoning_parser` names the family. Both tags are single tokens of those tokenizers, so the span is
followed by token id, not by text. The output starts inside the span unless the prompt's own end
closed it (Qwen3's template with `enable_thinking: false`, or a template that writes an empty span):
DeepSeek-R1's templates open the span in the prompt, Qwen3's leave the model to write `<think>`, which
is then read as the tag it is. Text inside the span is the reasoning; the tags are neither reasoning
nor answer. A budget closes the span: once the thinking has run for it, the next token is `</think>`.
gpt-oss's channels (`serve_app.engine.harmony`) are read through the same interface, `ThinkingReader`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, Protocol

from serve_app.model.tokenizer import Tokenizer
from serve_app.wire.model_card import ReasoningParser

# Each parser's tags (both families write the same two).
_TAGS: dict[str, tuple[str, str]] = {"qwen3": ("<think>", "</think>"), "deepseek_r1": ("<think>", "</think>")}

Phase = Literal["tag", "thinking", "answer"]


class ThinkingReader(Protocol):
    """One request's output read token by token: thinking, tags, or the answer."""

    grammar_reads_tags: bool  # whether the request's grammar reads the tags (it always reads the answer)
    tokens: int  # thinking tokens so far (what the budget counts)
    reasoning_tokens: int  # output tokens that were the thinking's, its tags included (what usage reports)

    @property
    def open(self) -> bool:
        """Whether the output is inside the thinking now (its text is reasoning, no grammar holds it)."""

    def accept(self, token: int) -> Phase:
        """Read one output token: what it is part of."""

    @property
    def forced_token(self) -> int | None:
        """The token that ends the thinking once its budget is spent."""


class ReasoningMarkers(Protocol):
    """A reasoning model's markers as token ids, and the reader of one request's output."""

    token_ids: tuple[int, ...]  # the markers (kept choosable under `allowed_token_ids`)

    def span(self, prompt_ids: Sequence[int], budget: int | None, keep_headers: bool) -> ThinkingReader:
        """A reader of the output that follows `prompt_ids`; `keep_headers`: a tool-mode answer, whose format's
        headers are part of its text (gpt-oss's)."""


class ThinkingTags:
    """A model's thinking tags as token ids, and which tokens are only whitespace (what may follow a closed span)."""

    def __init__(self, start: int, end: int, decode: Callable[[list[int]], str]) -> None:
        self.start = start
        self.end = end
        self.token_ids = (start, end)
        self._decode = decode

    @classmethod
    def of(cls, parser: ReasoningParser, tokenizer: Tokenizer) -> ThinkingTags:
        """The tags of `parser` in `tokenizer`; ValueError where the tokenizer lacks them as single tokens."""
        ids = []
        for tag in _TAGS[parser]:
            encoded = tokenizer.encode(tag, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(f"reasoning_parser {parser}: this model's tokenizer has no {tag} token")
            ids.append(int(encoded[0]))
        return cls(ids[0], ids[1], tokenizer.decode)

    def span(self, prompt_ids: Sequence[int], budget: int | None, keep_headers: bool) -> ThinkingSpan:
        return ThinkingSpan(self, prompt_ids, budget)

    def opens_output(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the output begins inside the span: unless the prompt ends with a closed one."""
        for token in reversed(prompt_ids):
            if token == self.end:
                return False
            if self._decode([token]).strip():
                return True
        return True


class ThinkingSpan:
    """One request's thinking: whether it is still open, how many tokens it has run, and its budget."""

    grammar_reads_tags = False  # a grammar holds the answer after `</think>`

    def __init__(self, tags: ThinkingTags, prompt_ids: Sequence[int], budget: int | None = None) -> None:
        self.tags = tags
        self.open = tags.opens_output(prompt_ids)
        self.budget = budget  # thinking tokens at most (None: as many as the output's own limit allows)
        self.tokens = 0
        self.reasoning_tokens = 0
        self._first = True  # a `<think>` as the output's first token is the tag the template left to the model

    def accept(self, token: int) -> Phase:
        """Read one output token: what it is part of."""
        first, self._first = self._first, False
        if not self.open:
            return "answer"
        self.reasoning_tokens += 1
        if token == self.tags.end:
            self.open = False
            return "tag"
        if first and token == self.tags.start:
            return "tag"
        self.tokens += 1
        return "thinking"

    @property
    def forced_token(self) -> int | None:
        """`</think>` once the thinking has spent its budget, for the next token."""
        if self.open and self.budget is not None and self.tokens >= self.budget:
            return self.tags.end
        return None
