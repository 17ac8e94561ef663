"""TaskOutput: what one request's tokens become on their way out of the engine -- its text (detokenized, held to
its stop strings and its answer guard), its reasoning (apart, past them), the deltas that carry them and where those
go (`DeltaSink`: a result in process, the engine process's outbox in its own)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from serve_app.engine.stopping import StopStringMatcher
from serve_app.model.detokenizer import IncrementalDetokenizer
from serve_app.wire.outputs import FinishReason, StreamDelta, TokenLogprob, Usage

if TYPE_CHECKING:
    from serve_app.engine.answer_guard import AnswerGuard
    from serve_app.engine.reasoning import Phase, ThinkingReader

# Where a task's deltas go: called with its id and each delta, on the engine's thread (keep it tiny).
DeltaSink = Callable[[int, StreamDelta], None]


@dataclass
class TaskOutput:
    """One request's way out: where its deltas go, how its tokens become text and reasoning, and whether its outcome
    is its prompt's embedding instead."""

    out: DeltaSink
    detokenizer: IncrementalDetokenizer
    stop_strings: StopStringMatcher
    guard: AnswerGuard | None = None  # a JSON or tool-call answer's repeats and lengths
    thinking: ThinkingReader | None = None  # a reasoning model's thinking, before the answer its grammar holds
    embed: bool = False  # its prompt's embedding is its outcome: it ends when its prefill does
    published: bool = False  # a delta has gone out

    def publish(self, task_id: int, delta: StreamDelta, usage: Usage, queue_time_s: float | None) -> None:
        """Send a delta on: the first carries the usage so far and the queue time, the last the final usage."""
        if not self.published:
            self.published = True
            delta = replace(delta, usage=usage, queue_time_s=queue_time_s)
        elif delta.finish_reason is not None:
            delta = replace(delta, usage=usage)
        self.out(task_id, delta)

    def delta(
        self,
        token: int,
        phase: Phase,
        was_thinking: bool,
        logprobs: tuple[TokenLogprob, ...],
        under_min_tokens: bool,
        at_limit: bool,
    ) -> StreamDelta:
        """What an accepted token adds: reasoning while thinking, else text through the guard and the stop strings
        (which end no answer under `min_tokens`); a tag adds neither, and what the detokenizer held goes out before
        it to the side it belonged to. `at_limit`: the token spent the task's budget or the context."""
        if phase == "tag":
            held = self.detokenizer.flush()
            self.detokenizer.skip(token)
        else:
            held = self.detokenizer.push(token)
        if phase == "thinking" or (phase == "tag" and was_thinking):
            if at_limit:
                closing = self.closing_delta("length", (token,), logprobs=logprobs)
                return replace(closing, reasoning=held + closing.reasoning)
            return StreamDelta("", (token,), logprobs=logprobs, reasoning=held)
        if self.guard is not None and (reason := self.guard.after(held)) is not None:
            return self.closing_delta(reason, (token,), self.stop_strings.feed(held), logprobs)
        stops = self.stop_strings
        text = stops.pass_through(held) if under_min_tokens else stops.feed(held)
        if stops.matched is not None:
            return StreamDelta(text, (token,), "stop", logprobs, stop_string=stops.matched)
        if at_limit:
            return self.closing_delta("length", (token,), text, logprobs)
        return StreamDelta(text, (token,), logprobs=logprobs)

    def closing_delta(
        self,
        reason: FinishReason,
        token_ids: tuple[int, ...] = (),
        text: str = "",
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> StreamDelta:
        """The last delta: `text` plus whatever the detokenizer and stop matcher still hold (as reasoning, where
        the thinking is still open)."""
        if self.thinking is not None and self.thinking.open:
            reasoning = self.detokenizer.flush()
            return StreamDelta(text + self.stop_strings.flush(), token_ids, reason, logprobs, reasoning=reasoning)
        text += self.stop_strings.feed(self.detokenizer.flush())
        if self.stop_strings.matched is not None:
            return StreamDelta(text, token_ids, "stop", logprobs, stop_string=self.stop_strings.matched)
        return StreamDelta(text + self.stop_strings.flush(), token_ids, reason, logprobs)
