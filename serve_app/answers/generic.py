"""The generic tool-call format's answers: `{"tool_calls": [...]}`, or `{"response": ...}` for text or, with an
answer schema, the answer's JSON."""

from __future__ import annotations

import re

from serve_app.answers.reader import MOST_CLOSER, MOST_HEADER, NAME, CallReader
from serve_app.answers.scanning import JsonScanner, decode_string


class GenericReader(CallReader):
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
                return self._give_up(MOST_HEADER)
            case "response":
                decoded, end = decode_string(buffer, at)
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
                return self._give_up(MOST_HEADER)
            case "arguments":
                return self._read_arguments()
            case "closer":
                if (closer := self._CLOSER.match(buffer, at)) is not None:
                    self._state, self._at = ("header" if closer.group("more") else "done"), closer.end()
                    return True
                return self._give_up(MOST_CLOSER)
            case _:
                self._at = len(buffer)
                return False

    def _give_up(self, most: int) -> bool:
        """Wait for more text, unless `most` characters came without a match: then nothing more is read."""
        if len(self._buffer) - self._at > most:
            self._state, self._at = "done", len(self._buffer)
        return False
