"""Qwen3-Coder's XML tool calls, each value typed by its tool's schema."""

from __future__ import annotations

import json
import re
from typing import Any

from serve_app.answers.reader import MOST_HEADER, TOOL_NAME, AnswerReader
from serve_app.answers.scanning import JsonScanner, held_back


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
                    end = len(buffer) - held_back(buffer, self._at, (self._MARKER,))
                    self._text(buffer[self._at : end])
                    self._at = end
                    return
                self._text(buffer[self._at : start])
                self._in_call, self._at, self._searched = True, start, start
                continue
            end = buffer.find(self._END, max(self._searched, self._at))
            if end < 0:
                self._searched = max(self._at, len(buffer) - len(self._END) + 1)
                if final or not self._may_be_a_call(buffer[self._at : self._at + MOST_HEADER]):
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
        return len(opening) < MOST_HEADER and "<function=".startswith(rest)

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
