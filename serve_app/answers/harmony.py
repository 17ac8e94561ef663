"""gpt-oss's harmony answers, their headers kept: calls to `functions.NAME`, final and commentary text."""

from __future__ import annotations

import re

from serve_app.answers.reader import MOST_HEADER, TOOL_NAME, CallArguments, CallReader
from serve_app.answers.scanning import held_back


class HarmonyReader(CallReader):
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
                    if final or len(buffer) - at > MOST_HEADER:  # no message follows
                        self._state, self._at = "done", len(buffer)
                    return False
                header, self._at = buffer[at:end], end + len(self._MESSAGE)
                if (recipient := self._RECIPIENT.search(header)) is not None:
                    self._arguments, self._state = CallArguments(recipient.group("name")), "arguments"
                    return True
                channel = self._CHANNEL.search(header)
                self._state = "analysis" if channel is not None and channel.group("channel") == "analysis" else "text"
                return True
            case "text" | "analysis":
                end = buffer.find(self._END, at)
                settled = end if end >= 0 else len(buffer) - held_back(buffer, at, (self._END,))
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
