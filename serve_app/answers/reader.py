"""Reading a structured answer as it is written: its text and its tool calls in order, in each tool-call
format, from text fed in pieces. Each character is looked at a bounded number of times, so an answer of
n characters costs O(n) over all its pieces.

A call is read once its arguments' JSON value is whole; a call identical to one already read in the
same answer (same tool, same arguments) is not a call: it marks the answer `repeated` and ends the
reading. Text that may still turn out to start a call waits until that is known; `finish` says whether
the answer ended where its grammar let it end (held-back text is then text) or was cut (what is not
certain is dropped), so a cut answer never shows a half-written call or the format's wrapper.

The engine reads with it to end an answer at a repeated call and to bound its JSON strings
(`serve_app.engine.answer_guard`); the HTTP layer, to answer in each API's shape.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

from serve_app.answers.scanning import JsonScanner

NAME = r'"(?P<name>(?:[^"\\]|\\.)*)"'  # a JSON string, its body captured as `name`
TOOL_NAME = r"(?P<name>[A-Za-z0-9_-]{1,64})"  # a tool's name as both APIs allow it, written bare
# A header or closer that has not matched within this many characters never will: what follows is not a call.
MOST_HEADER = 512
MOST_CLOSER = 64


@dataclass(frozen=True)
class TextPart:
    """Text of an answer that is not a call."""

    text: str


@dataclass(frozen=True)
class CallPart:
    """A call whose arguments are whole: its tool, and its arguments' JSON text as written."""

    name: str
    arguments: str


AnswerPart = TextPart | CallPart


class AnswerReader(ABC):
    """One answer, read as it grows. `feed` returns the parts its new text settles; `finish` the rest."""

    def __init__(self) -> None:
        self.repeated = False  # a call repeated an earlier one: the answer ends there
        self._buffer = ""  # text not yet settled (`_at` is where reading resumes in it)
        self._at = 0
        self._parts: list[AnswerPart] = []
        self._calls: set[tuple[str, str]] = set()
        self._after_call = False  # a call was just read: the text after it starts without separators

    def feed(self, text: str) -> list[AnswerPart]:
        if self.repeated or not text:
            return []
        self._buffer = self._buffer[self._at :] + text
        self._at = 0
        self._read(final=False)
        return self._take()

    def finish(self, complete: bool) -> list[AnswerPart]:
        """The parts left once the answer has ended: `complete` when its grammar ended it (or the model
        stopped where the grammar allowed), not when a token limit or a stop sequence cut it."""
        if not self.repeated:
            self._read(final=complete)
            if complete:
                self._flush()
        return self._take()

    @property
    @abstractmethod
    def constrained(self) -> bool:
        """Whether the answer is now inside its constrained JSON (a call, or a JSON answer)."""

    @property
    def open_string(self) -> tuple[int, int] | None:
        """Which string of its constrained JSON the answer is now inside (equal while it is the same one), if any."""
        scanner = self._json_scanner()
        return (id(scanner), scanner.strings) if scanner is not None and scanner.in_string else None

    @property
    def string_may_close(self) -> bool:
        """Whether the answer is inside such a string and its next character may close it (no backslash before)."""
        scanner = self._json_scanner()
        return scanner is not None and scanner.in_string and not scanner.escaped

    @abstractmethod
    def _json_scanner(self) -> JsonScanner | None:
        """The scanner of the constrained JSON value being written now, if any."""

    @abstractmethod
    def _read(self, final: bool) -> None:
        """Settle what the buffer allows from `_at` on (`final`: the answer is whole, wait for nothing)."""

    def _flush(self) -> None:
        """At the end of a whole answer: settle what was held back."""

    def _text(self, text: str) -> None:
        """Text of the answer (what follows a call goes without its leading separators)."""
        if self._after_call:
            text = text.lstrip(" \n;")
            self._after_call = not text
        if text:
            if self._parts and isinstance(self._parts[-1], TextPart):
                self._parts[-1] = TextPart(self._parts[-1].text + text)
            else:
                self._parts.append(TextPart(text))

    def _call(self, name: str, arguments: str) -> None:
        """A call whose arguments are whole; one that repeats an earlier call ends the answer instead."""
        try:
            key = (name, json.dumps(json.loads(arguments), sort_keys=True))
        except json.JSONDecodeError:
            return  # not JSON after all: not a call
        if key in self._calls:
            self.repeated = True
            return
        self._calls.add(key)
        self._parts.append(CallPart(name, arguments))

    def _take(self) -> list[AnswerPart]:
        parts, self._parts = self._parts, []
        return parts


class CallArguments:
    """A call's arguments as they are read: its tool, the scanner over its JSON, the text so far."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.scanner = JsonScanner()
        self.pieces: list[str] = []


class CallReader(AnswerReader):
    """What both tool-call formats share: a state machine stepped over the buffer, and a call's arguments
    read from its header's end to their value's end."""

    def __init__(self, state: str) -> None:
        super().__init__()
        self._state = state
        self._arguments: CallArguments | None = None

    def _json_scanner(self) -> JsonScanner | None:
        return self._arguments.scanner if self._state == "arguments" and self._arguments is not None else None

    def _read(self, final: bool) -> None:
        while self._at < len(self._buffer) and self._step(final):
            pass

    @abstractmethod
    def _step(self, final: bool) -> bool:
        """Read one thing; False when the buffer holds nothing more to settle now."""

    def _flush(self) -> None:
        """What a whole answer still holds is text, where it is in text."""
        if self._state == "text":
            self._text(self._buffer[self._at :])
        self._at = len(self._buffer)

    def _open_call(self, header: re.Match[str]) -> bool:
        """A call's header is read (its tool's name in group `name`): its arguments come next."""
        self._arguments = CallArguments(json.loads(f'"{header.group("name")}"', strict=False))
        self._state, self._at = "arguments", header.end()
        return True

    def _read_arguments(self) -> bool:
        """Read on in the open call's arguments; once their value ends, the call (then its closer)."""
        arguments, buffer, at = self._arguments, self._buffer, self._at
        assert arguments is not None
        end = arguments.scanner.feed(buffer, at)
        arguments.pieces.append(buffer[at:end])
        if end is None:
            self._at = len(buffer)
            return False
        self._call(arguments.name, "".join(arguments.pieces).strip())
        self._state, self._at, self._arguments = "closer", end, None
        return not self.repeated


class JsonAnswerReader(AnswerReader):
    """An answer that is one JSON value (a `json` or `json_object` constraint): no calls, all constrained."""

    def __init__(self) -> None:
        super().__init__()
        self._scanner = JsonScanner()

    @property
    def constrained(self) -> bool:
        return not self._scanner.ended

    def _json_scanner(self) -> JsonScanner | None:
        return self._scanner

    def _read(self, final: bool) -> None:
        if not self._scanner.ended:
            self._scanner.feed(self._buffer, self._at)
        self._at = len(self._buffer)
