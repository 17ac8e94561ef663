"""One tool-mode answer as it streams: its text as it comes, and each call (its id and tool, then its
arguments) once its arguments are whole, so a client never sees a call that the token limit cuts or a
repeat of an earlier call. Read off the new text of each delta (`serve_app.answers`)."""

from __future__ import annotations

from dataclasses import dataclass

from serve_app.answers.reader import AnswerPart, AnswerReader, CallPart
from serve_app.http.tools.plan import new_call_id


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
    """What one answer has streamed so far, and what each new piece of its text adds."""

    def __init__(self, reader: AnswerReader, id_prefix: str) -> None:
        self.reader = reader
        self.id_prefix = id_prefix
        self.call_ids: list[str] = []

    def feed(self, text: str) -> list[ToolStreamEvent]:
        """The events that `text`, the answer's next piece, settles."""
        return self._events(self.reader.feed(text))

    def finish(self, complete: bool) -> list[ToolStreamEvent]:
        """The events left once the answer has ended (`complete`: not cut by a token limit or a stop sequence)."""
        return self._events(self.reader.finish(complete))

    def _events(self, parts: list[AnswerPart]) -> list[ToolStreamEvent]:
        events: list[ToolStreamEvent] = []
        for part in parts:
            if isinstance(part, CallPart):
                call = len(self.call_ids)
                self.call_ids.append(new_call_id(self.id_prefix))
                events += [CallStarted(call, self.call_ids[call], part.name), ArgumentsDelta(call, part.arguments)]
            else:
                events.append(TextDelta(part.text))
        return events

    @property
    def called(self) -> bool:
        return bool(self.call_ids)
