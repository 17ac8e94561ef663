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
from typing import Any

from serve_app.engine.io import StructuredOutput, ToolCallGrammar

NAME = r'"(?P<name>(?:[^"\\]|\\.)*)"'  # a JSON string, its body captured as `name`
TOOL_NAME = r"(?P<name>[A-Za-z0-9_-]{1,64})"  # a tool's name as both APIs allow it, written bare
# A header or closer that has not matched within this many characters never will: what follows is not a call.
_MOST_HEADER = 512
_MOST_CLOSER = 64


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


class JsonScanner:
    """Where one JSON value being written stands: inside a string or not, how deep, whether it has ended."""

    def __init__(self) -> None:
        self.in_string = False
        self.escaped = False  # the string's last character was a backslash
        self.strings = 0  # strings opened so far
        self._depth = 0
        self._started = False
        self._scalar = False
        self.ended = False

    def feed(self, text: str, start: int = 0) -> int | None:
        """Read `text[start:]`: the index just past the value when it ends there, else None (all of it read)."""
        for index in range(start, len(text)):
            char = text[index]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    if self._depth == 0:
                        return self._end(index + 1)
            elif not self._started:
                if not char.isspace():
                    self._started = True
                    self.in_string = char == '"'
                    self.strings += self.in_string
                    self._scalar = char not in '"{['
                    self._depth = 1 if char in "{[" else 0
            elif self._scalar:
                if char.isspace() or char in ",]}":
                    return self._end(index)
            elif char == '"':
                self.in_string = True
                self.strings += 1
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return self._end(index + 1)
        return None

    def _end(self, index: int) -> int:
        self.ended = True
        return index


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


class _Arguments:
    """A call's arguments as they are read: its tool, the scanner over its JSON, the text so far."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.scanner = JsonScanner()
        self.pieces: list[str] = []


class _CallReader(AnswerReader):
    """What both tool-call formats share: a state machine stepped over the buffer, and a call's arguments
    read from its header's end to their value's end."""

    def __init__(self, state: str) -> None:
        super().__init__()
        self._state = state
        self._arguments: _Arguments | None = None

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
        self._arguments = _Arguments(json.loads(f'"{header.group("name")}"', strict=False))
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


class GenericReader(_CallReader):
    """The generic format: `{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`, or `{"response": ...}`
    whose value is the answer's text (a string) or, with an answer schema, the answer's JSON itself."""

    _ANSWER = re.compile(r'\s*\{\s*"response"\s*:\s*')
    _TEXT_ANSWER = re.compile(r'\s*\{\s*"response"\s*:\s*"')
    _CALLS = re.compile(r'\s*\{\s*"tool_calls"\s*:\s*\[')
    _HEADER = re.compile(rf'\s*\{{\s*"name"\s*:\s*{NAME}\s*,\s*"arguments"\s*:\s*')
    _CLOSER = re.compile(r"\s*\}\s*(?:(?P<more>,)|\])")
    _LIST_END = re.compile(r"\s*\]")

    def __init__(self, json_answer: bool) -> None:
        super().__init__("start")  # start, response, response_json, header, arguments, closer, done
        self._json_answer = json_answer
        self._answer = JsonScanner()

    @property
    def constrained(self) -> bool:
        return self._state != "response"

    def _json_scanner(self) -> JsonScanner | None:
        return self._answer if self._state == "response_json" else super()._json_scanner()

    def _step(self, final: bool) -> bool:
        buffer, at = self._buffer, self._at
        match self._state:
            case "start":
                answer = (self._ANSWER if self._json_answer else self._TEXT_ANSWER).match(buffer, at)
                if answer is not None:
                    self._state, self._at = ("response_json" if self._json_answer else "response"), answer.end()
                    return True
                if (calls := self._CALLS.match(buffer, at)) is not None:
                    self._state, self._at = "header", calls.end()
                    return True
                return self._give_up(_MOST_HEADER)
            case "response":
                decoded, end = _decode_string(buffer, at)
                self._text(decoded)
                self._at = end
                if end < len(buffer) and buffer[end] == '"':
                    self._state, self._at = "done", len(buffer)
                return False
            case "response_json":
                end = self._answer.feed(buffer, at)
                self._text(buffer[at:end])
                self._at = len(buffer) if end is None else end
                if end is not None:
                    self._state, self._at = "done", len(buffer)
                return False
            case "header":
                if (header := self._HEADER.match(buffer, at)) is not None:
                    return self._open_call(header)
                if self._LIST_END.match(buffer, at) is not None:
                    self._state, self._at = "done", len(buffer)
                    return False
                return self._give_up(_MOST_HEADER)
            case "arguments":
                return self._read_arguments()
            case "closer":
                if (closer := self._CLOSER.match(buffer, at)) is not None:
                    self._state, self._at = ("header" if closer.group("more") else "done"), closer.end()
                    return True
                return self._give_up(_MOST_CLOSER)
            case _:
                self._at = len(buffer)
                return False

    def _give_up(self, most: int) -> bool:
        """Wait for more text, unless `most` characters came without a match: then nothing more is read."""
        if len(self._buffer) - self._at > most:
            self._state, self._at = "done", len(self._buffer)
        return False


class TemplateReader(_CallReader):
    """A chat template's own format: text until one of `markers`; a call is `header` (the tool's name in
    group `name`), its arguments' JSON value, `closer`; text may follow a call."""

    def __init__(
        self,
        markers: tuple[str, ...],
        header: re.Pattern[str],
        arguments_key: re.Pattern[str],
        closer: re.Pattern[str],
        trailer: str | None = None,
    ) -> None:
        super().__init__("text")  # text, header, arguments, closer
        self._markers = markers if trailer is None else (*markers, trailer)
        self._trailer = trailer  # what closes a run of calls (DeepSeek's): neither text nor a call
        self._header = header
        self._arguments_key = arguments_key  # the header's last key: a marker without it may still become a call
        self._closer = closer

    @property
    def constrained(self) -> bool:
        return self._state != "text"

    def _step(self, final: bool) -> bool:
        buffer, at = self._buffer, self._at
        match self._state:
            case "text":
                start = self._next_marker(buffer, at)
                if start is None:
                    end = len(buffer) - _held_back(buffer, at, self._markers)
                    self._text(buffer[at:end])
                    self._at = end
                    return False
                self._text(buffer[at:start])
                self._state, self._at = "header", start
                return True
            case "header":
                if (header := self._header.match(buffer, at)) is not None:
                    return self._open_call(header)
                if self._trailer is not None and buffer.startswith(self._trailer, at):
                    self._state, self._at = "text", at + len(self._trailer)
                    return True
                window = buffer[at : at + _MOST_HEADER]
                if not final and len(window) < _MOST_HEADER and self._arguments_key.search(window) is None:
                    return False  # may still become a call
                self._text(buffer[at])  # the marker starts no call: it is text
                self._state, self._at = "text", at + 1
                return True
            case "arguments":
                return self._read_arguments()
            case _:  # closer
                closer = self._closer.match(buffer, at)
                settled = closer is not None and (closer.end() < len(buffer) or final)
                if not settled and not final and len(buffer) - at <= _MOST_CLOSER:
                    return False  # the closer may still come, or go on
                self._state, self._after_call = "text", True
                self._at = closer.end() if closer is not None else at
                return True

    def _next_marker(self, text: str, position: int) -> int | None:
        found = [i for i in (text.find(m, position) for m in self._markers) if i >= 0]
        return min(found, default=None)


class HarmonyReader(_CallReader):
    """gpt-oss's harmony messages, headers kept (a tool-mode answer's text, `serve_app.engine.harmony`): a message to
    `functions.NAME` is a call, its body the arguments; a final or commentary message's body is text; an analysis
    message's body (the reasoning, sent apart) is neither. A call's `<|call|>` ends the output."""

    _MESSAGE = "<|message|>"
    _END = "<|end|>"
    _RECIPIENT = re.compile(rf"to=functions\.{TOOL_NAME}")
    _CHANNEL = re.compile(r"<\|channel\|>\s*(?P<channel>\w+)")

    def __init__(self) -> None:
        super().__init__("header")  # header, text, analysis, arguments, closer, done

    @property
    def constrained(self) -> bool:
        return self._state != "text"

    def _step(self, final: bool) -> bool:
        buffer, at = self._buffer, self._at
        match self._state:
            case "header":
                end = buffer.find(self._MESSAGE, at)
                if end < 0:
                    if final or len(buffer) - at > _MOST_HEADER:  # no message follows
                        self._state, self._at = "done", len(buffer)
                    return False
                header, self._at = buffer[at:end], end + len(self._MESSAGE)
                if (recipient := self._RECIPIENT.search(header)) is not None:
                    self._arguments, self._state = _Arguments(recipient.group("name")), "arguments"
                    return True
                channel = self._CHANNEL.search(header)
                self._state = "analysis" if channel is not None and channel.group("channel") == "analysis" else "text"
                return True
            case "text" | "analysis":
                end = buffer.find(self._END, at)
                settled = end if end >= 0 else len(buffer) - _held_back(buffer, at, (self._END,))
                if self._state == "text":
                    self._text(buffer[at:settled])
                if end < 0:
                    self._at = settled
                    return False
                self._state, self._at = "header", end + len(self._END)
                return True
            case "arguments":
                return self._read_arguments()
            case "closer":  # what follows a call is the next message's header
                self._state, self._after_call = "header", True
                return True
            case _:
                self._at = len(buffer)
                return False


class XmlCallReader(AnswerReader):
    """Qwen3-Coder's format: text, then calls written as `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE
    \\n</parameter>...</function>\\n</tool_call>`. A call is read once its `</tool_call>` is written; each value is
    typed by its tool's schema (a string as written, a number, boolean, array or object as JSON)."""

    _MARKER = "<tool_call>"
    _END = "</tool_call>"
    _CALL = re.compile(rf"<tool_call>\s*<function={TOOL_NAME}>(?P<body>.*)</function>\s*</tool_call>", re.S)
    _PARAMETER = re.compile(r"<parameter=(?P<key>[^>\n]{1,256})>\n?(?P<value>.*?)\n?</parameter>", re.S)
    _CALL_START = re.compile(r"<tool_call>\s*<function=")

    def __init__(self, parameters: dict[str, dict[str, Any]]) -> None:
        super().__init__()
        self._parameters = parameters  # each tool's parameters schema, for its values' types
        self._in_call = False
        self._searched = 0  # where the open call's `</tool_call>` has been looked for up to

    @property
    def constrained(self) -> bool:
        return self._in_call

    def _json_scanner(self) -> JsonScanner | None:
        return None  # values are written as they are, not as JSON strings

    def _read(self, final: bool) -> None:
        buffer = self._buffer
        while self._at < len(buffer):
            if not self._in_call:
                start = buffer.find(self._MARKER, self._at)
                if start < 0:
                    end = len(buffer) - _held_back(buffer, self._at, (self._MARKER,))
                    self._text(buffer[self._at : end])
                    self._at = end
                    return
                self._text(buffer[self._at : start])
                self._in_call, self._at, self._searched = True, start, start
                continue
            end = buffer.find(self._END, max(self._searched, self._at))
            if end < 0:
                self._searched = max(self._at, len(buffer) - len(self._END) + 1)
                if final or not self._may_be_a_call(buffer[self._at : self._at + _MOST_HEADER]):
                    self._not_a_call()
                    continue
                return
            call = self._CALL.match(buffer, self._at, end + len(self._END))
            if call is None:
                self._not_a_call()
                continue
            self._in_call, self._at = False, call.end()
            self._after_call = True
            arguments = self._arguments(call.group("name"), call.group("body"))
            self._call(call.group("name"), json.dumps(arguments, ensure_ascii=False))
            if self.repeated:
                return

    def _may_be_a_call(self, opening: str) -> bool:
        """Whether what follows a marker starts a call, or may still (it is a start of `<function=`)."""
        if self._CALL_START.match(opening):
            return True
        rest = opening[len(self._MARKER) :].lstrip()
        return len(opening) < _MOST_HEADER and "<function=".startswith(rest)

    def _not_a_call(self) -> None:
        """The marker at `_at` starts no call: it is text."""
        self._text(self._buffer[self._at])
        self._in_call, self._at = False, self._at + 1

    def _arguments(self, name: str, body: str) -> dict[str, Any]:
        properties = self._parameters.get(name, {}).get("properties", {})
        return {
            match.group("key"): _typed(match.group("value"), properties.get(match.group("key"), {}))
            for match in self._PARAMETER.finditer(body)
        }

    def _flush(self) -> None:
        if not self._in_call:
            self._text(self._buffer[self._at :])
        self._at = len(self._buffer)


def _typed(value: str, schema: dict[str, Any]) -> Any:
    """A Qwen XML parameter's value as its schema types it: a string as written, anything else read as JSON (a
    boolean case-blind), a string where it is not JSON."""
    kind = schema.get("type")
    if kind == "string":
        return value
    if kind == "boolean" and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


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


_HERMES = (
    ("<tool_call>",),
    re.compile(rf'<tool_call>\s*\{{\s*"name"\s*:\s*{NAME}\s*,\s*"arguments"\s*:\s*'),
    re.compile(r'"arguments"\s*:'),
    re.compile(r"\s*\}\s*</tool_call>"),
)
_LLAMA3_JSON = (
    ("<|python_tag|>", '{"name"'),
    re.compile(rf'(?:<\|python_tag\|>\s*)?\{{\s*"name"\s*:\s*{NAME}\s*,\s*"parameters"\s*:\s*'),
    re.compile(r'"parameters"\s*:'),
    re.compile(r"\s*\}\s*;?"),
)
# Mistral's: `[TOOL_CALLS]name[ARGS]{...}` per call (the history's `[CALL_ID]` read where a model writes one).
_MISTRAL = (
    ("[TOOL_CALLS]",),
    re.compile(rf"\[TOOL_CALLS\]{TOOL_NAME}(?:\[CALL_ID\][A-Za-z0-9]{{9}})?\[ARGS\]"),
    re.compile(r"\[ARGS\]"),
    re.compile(r""),  # the arguments end the call
)
# DeepSeek-V3.1's: `<｜tool▁calls▁begin｜>` then `<｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` per call.
_DEEPSEEK_V31 = (
    ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"),
    re.compile(rf"(?:<｜tool▁calls▁begin｜>\s*)?<｜tool▁call▁begin｜>{TOOL_NAME}<｜tool▁sep｜>"),
    re.compile(r"<｜tool▁sep｜>"),
    re.compile(r"\s*<｜tool▁call▁end｜>"),
    "<｜tool▁calls▁end｜>",
)
_TEMPLATE_FORMATS = {"hermes": _HERMES, "llama3_json": _LLAMA3_JSON, "mistral": _MISTRAL, "deepseek_v31": _DEEPSEEK_V31}


def tool_reader(spec: ToolCallGrammar) -> AnswerReader:
    """A reader of answers in `spec`'s format."""
    if spec.format == "generic":
        return GenericReader(json_answer=spec.answer_schema is not None)
    if spec.format == "qwen3_coder":
        return XmlCallReader({tool.name: tool.parameters for tool in spec.tools})
    if spec.format == "openai":
        return HarmonyReader()
    return TemplateReader(*_TEMPLATE_FORMATS[spec.format])


def reader_for(spec: StructuredOutput) -> AnswerReader | None:
    """A reader of answers under `spec`, where they are JSON or tool calls (None for a regex, choice or grammar)."""
    if spec.tool_calls is not None:
        return tool_reader(spec.tool_calls)
    return JsonAnswerReader() if spec.is_json else None


def _decode_string(text: str, begin: int) -> tuple[str, int]:
    """The decoded part of a JSON string body from `begin`: as far as whole characters go, up to its closing
    quote; and where that part ends (at the quote, or where an escape or a surrogate pair is still half written)."""
    position = begin
    while position < len(text) and text[position] != '"':
        if text[position] == "\\":
            width = 6 if text[position + 1 : position + 2] == "u" else 2
            if position + width > len(text):
                break
            position += width
        else:
            position += 1
    decoded = json.loads(f'"{text[begin:position]}"', strict=False)
    if decoded and "\ud800" <= decoded[-1] <= "\udbff":  # half a surrogate pair: wait for the other half
        return decoded[:-1], position - 6
    return decoded, position


def _held_back(text: str, begin: int, markers: tuple[str, ...]) -> int:
    """How many of `text[begin:]`'s last characters may be the start of one of `markers`."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text) - begin), longest, -1):
            if marker.startswith(text[len(text) - size :]):
                longest = size
                break
    return longest
