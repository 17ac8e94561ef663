"""Reading JSON and markers as text arrives: where one JSON value being written stands (`JsonScanner`), a JSON
string's decoded body so far, and how much of a text's end may still become a marker."""

from __future__ import annotations

import json


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


def decode_string(text: str, begin: int) -> tuple[str, int]:
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


def held_back(text: str, begin: int, markers: tuple[str, ...]) -> int:
    """How many of `text[begin:]`'s last characters may be the start of one of `markers`."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text) - begin), longest, -1):
            if marker.startswith(text[len(text) - size :]):
                longest = size
                break
    return longest
