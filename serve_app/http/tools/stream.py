"""One tool-mode answer as it streams: its text as it comes, each call's start (id and tool) once its
name is written, then its arguments' JSON in pieces, read off the text so far by the request's format.
Text that may still turn out to start a call waits until that is known."""

from __future__ import annotations

from dataclasses import dataclass

from serve_app.http.tools.plan import CallSegment, ToolCallFormat, new_call_id


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class CallStarted:
    call: int  # the call's place among the answer's calls
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    call: int
    text: str


ToolStreamEvent = TextDelta | CallStarted | ArgumentsDelta


class ToolStream:
    """What one answer has streamed so far, and what its next reading adds."""

    def __init__(self, tools: ToolCallFormat, id_prefix: str) -> None:
        self.tools = tools
        self.id_prefix = id_prefix
        self.call_ids: list[str] = []
        self._sent: list[str] = []  # per segment: the text or arguments streamed so far

    def update(self, text: str, final: bool = False) -> list[ToolStreamEvent]:
        """The events that the answer's text so far (`final`: all of it) adds to those already sent.
        Text after a call streams without its leading whitespace."""
        events: list[ToolStreamEvent] = []
        calls = 0
        for index, segment in enumerate(self.tools.segments(text, final)):
            if index == len(self._sent):
                self._sent.append("")
                if isinstance(segment, CallSegment):
                    self.call_ids.append(new_call_id(self.id_prefix))
                    events.append(CallStarted(calls, self.call_ids[calls], segment.name))
            if isinstance(segment, CallSegment):
                now, calls = segment.arguments, calls + 1
            else:
                now = segment.text if index == 0 else segment.text.lstrip()
            sent = self._sent[index]
            if len(now) > len(sent) and now.startswith(sent):
                self._sent[index] = now
                added = now[len(sent) :]
                events.append(ArgumentsDelta(calls - 1, added) if isinstance(segment, CallSegment) else TextDelta(added))
        return events

    @property
    def called(self) -> bool:
        return bool(self.call_ids)
