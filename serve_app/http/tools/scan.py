"""Reading JSON as it is written: where a value ends (None while it is still open), how much of a
string is decoded so far, and how much of a text's tail may still become a marker."""

from __future__ import annotations

import json
import re

_SCALAR = re.compile(r"[^\s,\]}]+")
NAME = r'"(?P<name>(?:[^"\\]|\\.)*)"'  # a JSON string, its body captured as `name`


def value_end(text: str, begin: int) -> int | None:
    """The index just past the JSON value that starts at `begin` (after any whitespace), or None
    while `text` ends inside it."""
    position = begin
    while position < len(text) and text[position].isspace():
        position += 1
    if position == len(text):
        return None
    if text[position] == '"':
        return _string_end(text, position + 1)
    if text[position] not in "{[":
        scalar = _SCALAR.match(text, position)
        end = scalar.end() if scalar else position + 1
        return end if end < len(text) else None
    depth = 0
    while position < len(text):
        char = text[position]
        if char == '"':
            end = _string_end(text, position + 1)
            if end is None:
                return None
            position = end
            continue
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return position + 1
        position += 1
    return None


def _string_end(text: str, position: int) -> int | None:
    """Past the closing quote of a string whose body starts at `position`, or None while it is open."""
    while position < len(text):
        if text[position] == "\\":
            position += 2
        elif text[position] == '"':
            return position + 1
        else:
            position += 1
    return None


def string_so_far(text: str, begin: int) -> str:
    """The decoded part of the JSON string whose body starts at `begin`: up to its closing quote, or
    as far as whole characters go while it is still being written."""
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
        decoded = decoded[:-1]
    return decoded


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many of `text`'s last characters may be the start of one of `markers`."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-size:]):
                longest = size
                break
    return longest


def decode_name(body: str) -> str:
    """A JSON string's body (as `NAME` captures it), decoded."""
    return json.loads(f'"{body}"', strict=False)
