"""Answers in a chat template's own tool-call format (hermes, llama3_json, mistral, deepseek_v31): text, then calls
each written as a header naming the tool, its arguments' JSON, and a closer."""

from __future__ import annotations

import re

from serve_app.answers.reader import MOST_CLOSER, MOST_HEADER, NAME, TOOL_NAME, CallReader
from serve_app.answers.scanning import held_back


class TemplateReader(CallReader):
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
                    end = len(buffer) - held_back(buffer, at, self._markers)
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
                window = buffer[at : at + MOST_HEADER]
                if not final and len(window) < MOST_HEADER and self._arguments_key.search(window) is None:
                    return False  # may still become a call
                self._text(buffer[at])  # the marker starts no call: it is text
                self._state, self._at = "text", at + 1
                return True
            case "arguments":
                return self._read_arguments()
            case _:  # closer
                closer = self._closer.match(buffer, at)
                settled = closer is not None and (closer.end() < len(buffer) or final)
                if not settled and not final and len(buffer) - at <= MOST_CLOSER:
                    return False  # the closer may still come, or go on
                self._state, self._after_call = "text", True
                self._at = closer.end() if closer is not None else at
                return True

    def _next_marker(self, text: str, position: int) -> int | None:
        found = [i for i in (text.find(m, position) for m in self._markers) if i >= 0]
        return min(found, default=None)


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
TEMPLATE_FORMATS = {"hermes": _HERMES, "llama3_json": _LLAMA3_JSON, "mistral": _MISTRAL, "deepseek_v31": _DEEPSEEK_V31}
