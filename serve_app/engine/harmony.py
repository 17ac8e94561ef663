"""gpt-oss's harmony channels, token by token: which output tokens are thinking, which the answer, which headers.

A harmony model answers in messages: `<|channel|>analysis<|message|>...<|end|>` (its thinking), then
`<|start|>assistant<|channel|>final<|message|>...<|return|>` (the answer), or a call,
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` (the recipient may also come
before the channel). The chat template's generation prompt ends with `<|start|>assistant`, so the output starts in
a header. The markers are special tokens of its tokenizer; the rest of a header (the channel, the recipient) is
text, read once the header's `<|message|>` ends it. The analysis channel's body is the reasoning; every other body
is the answer. A tool-mode answer keeps its headers (the calls' recipients are in them: `serve_app.answers.harmony`
reads the messages back); any other answer leaves them out. A grammar reads the headers too (it holds the whole
message stream, `serve_app.engine.harmony_grammar`), but not the analysis bodies: the budget closes one with
`<|end|>`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from serve_app.engine.reasoning import Phase
from serve_app.model.tokenizer import Tokenizer

MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*(?P<channel>\w+)")


class HarmonyMarkers:
    """A harmony tokenizer's markers as token ids, and how to read a header's channel."""

    def __init__(self, ids: dict[str, int], decode: Callable[[list[int]], str]) -> None:
        self.message = ids["<|message|>"]
        self.end = ids["<|end|>"]
        self.body_ends = frozenset(ids[m] for m in ("<|end|>", "<|call|>", "<|return|>"))
        self.token_ids = tuple(ids.values())
        self._decode = decode

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> HarmonyMarkers:
        """The markers of `tokenizer`; ValueError where it lacks one as a single token."""
        ids = {}
        for marker in MARKERS:
            encoded = tokenizer.encode(marker, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(f"reasoning_parser openai_gptoss: this model's tokenizer has no {marker} token")
            ids[marker] = int(encoded[0])
        return cls(ids, lambda tokens: tokenizer.decode(tokens, skip_special_tokens=False))

    def channel_of(self, header: Sequence[int]) -> str | None:
        """The channel a header names (`analysis`, `commentary`, `final`), if it names one."""
        found = _CHANNEL.search(self._decode(list(header)))
        return found.group("channel") if found is not None else None

    def span(self, prompt_ids: Sequence[int], budget: int | None, keep_headers: bool) -> HarmonyChannels:
        return HarmonyChannels(self, budget, keep_headers)


class HarmonyChannels:
    """One request's messages as they are written: the header being read, the channel of the body, the thinking's
    tokens and budget."""

    grammar_reads_tags = True  # the headers are part of the harmony grammar

    def __init__(self, markers: HarmonyMarkers, budget: int | None, keep_headers: bool) -> None:
        self.markers = markers
        self.budget = budget  # analysis tokens at most (None: as many as the output's own limit allows)
        self.keep_headers = keep_headers  # a tool-mode answer: headers are part of its text
        self.tokens = 0
        self.reasoning_tokens = 0  # the analysis messages' tokens: headers, bodies and ends
        self._state = "header"  # header, analysis, answer
        self._header: list[int] = []

    @property
    def open(self) -> bool:
        """Whether the output is inside an analysis body (its text is reasoning)."""
        return self._state == "analysis"

    def accept(self, token: int) -> Phase:
        """Read one output token: what it is part of."""
        header: Phase = "answer" if self.keep_headers else "tag"
        if self._state == "header":
            if token == self.markers.message:
                if self.markers.channel_of(self._header) == "analysis":
                    self._state, self.reasoning_tokens = "analysis", self.reasoning_tokens + len(self._header) + 1
                else:
                    self._state = "answer"
                self._header = []
            else:
                self._header.append(token)
            return header
        if token in self.markers.body_ends:
            self.reasoning_tokens += self._state == "analysis"
            self._state = "header"
            return header
        if self._state == "analysis":
            self.tokens += 1
            self.reasoning_tokens += 1
            return "thinking"
        return "answer"

    @property
    def forced_token(self) -> int | None:
        """`<|end|>` once the analysis has spent the budget, for the next token."""
        if self.open and self.budget is not None and self.tokens >= self.budget:
            return self.markers.end
        return None
