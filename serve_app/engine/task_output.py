"""TaskOutput: what one request's tokens become on their way out of the engine core -- token ids with what each is
part of (`CoreOutput`), the usage on the first, the last and where the thinking's count changed -- and where they
go (`OutputSink`: a stream in process, the engine process's outbox in its own). Text is made outside the core."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from serve_app.wire.outputs import CoreOutput, FinishReason, SampledLogprob, Usage

if TYPE_CHECKING:
    from serve_app.engine.answer_guard import AnswerGuard
    from serve_app.engine.reasoning import Phase, ThinkingReader

# Where a task's outputs go: called with its id and each output, on the engine's thread (keep it tiny).
OutputSink = Callable[[int, CoreOutput], None]


@dataclass
class TaskOutput:
    """One request's way out: where its outputs go, what reads its thinking and guards its answer, and whether its
    outcome is its prompt's embedding instead."""

    out: OutputSink
    guard: AnswerGuard | None = None  # a JSON or tool-call answer's repeats and lengths
    thinking: ThinkingReader | None = None  # a reasoning model's thinking, before the answer its grammar holds
    embed: bool = False  # its prompt's embedding is its outcome: it ends when its prefill does
    published: bool = False  # an output has gone out
    reported_reasoning: int = 0  # the thinking's token count the last usage sent said

    def publish(self, task_id: int, output: CoreOutput, usage: Usage, queue_time_s: float | None) -> None:
        """Send an output on: the first carries the usage so far and the queue time, the last the final usage, and
        one after the thinking's count changed the usage so far (an output processor that ends the request early
        reports it)."""
        if not self.published:
            self.published = True
            output = replace(output, usage=usage, queue_time_s=queue_time_s)
        elif output.finish_reason is not None or usage.reasoning_tokens != self.reported_reasoning:
            output = replace(output, usage=usage)
        self.reported_reasoning = usage.reasoning_tokens
        self.out(task_id, output)

    def token(
        self, token: int, phase: Phase, was_thinking: bool, logprobs: tuple[SampledLogprob, ...], at_limit: bool
    ) -> CoreOutput:
        """What an accepted token adds: its id and part, and why it ends the task if it does -- its guard (a repeated
        call, the constrained tokens spent) reading the answer, or `at_limit` (it spent the budget or the context)."""
        reason: FinishReason | None = None
        if self.guard is not None:
            reason = self.guard.read(token, phase, was_thinking)
        if reason is None and at_limit:
            reason = "length"
        return CoreOutput((token,), (phase,), reason, logprobs)
