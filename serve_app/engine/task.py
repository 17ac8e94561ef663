"""Task: the scheduler's state for one request, from waiting through running to finished, and where its deltas
go (`DeltaSink`: a result in process, the engine process's outbox in its own)."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from serve_app.engine.speculation import TaskSpeculation
from serve_app.engine.stopping import StopStringMatcher
from serve_app.kv.tiers.pages import LoadedPages
from serve_app.model.detokenizer import IncrementalDetokenizer
from serve_app.wire.outputs import FinishReason, StreamDelta, TokenLogprob, Usage
from serve_app.wire.requests import SamplingParams

if TYPE_CHECKING:
    import xgrammar

    from serve_app.engine.answer_guard import AnswerGuard
    from serve_app.engine.reasoning import ThinkingReader


# Where a task's deltas go: called with its id and each delta, on the engine's thread (keep it tiny).
DeltaSink = Callable[[int, StreamDelta], None]


@dataclass(frozen=True)
class CachePin:
    """Keep the first `tokens` of the prompt cached for `ttl_s` once they are computed (a prompt-caching breakpoint)."""

    tokens: int
    ttl_s: float


class TaskState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Task:
    """Token ids so far (`tokens` = prompt + output), how many have k/v in the cache, and the stop rules."""

    task_id: int
    prompt_len: int
    tokens: list[int]
    params: SamplingParams
    max_tokens: int
    stop_token_ids: frozenset[int]
    prefix_salt: str  # the salt its prompt's pages are keyed under (the tenant's, and the adapter's)
    out: DeltaSink
    detokenizer: IncrementalDetokenizer
    stop_strings: StopStringMatcher
    generator: torch.Generator | None = None
    min_tokens: int = 0  # before this many output tokens, no stop token id may be chosen nor a stop string end it
    priority: int = 0  # lower is admitted first, under the priority scheduling policy
    pin: CachePin | None = None  # its prompt's prefix to keep cached, until its prefill has computed it
    cache_written_tokens: int = 0  # prompt tokens its pin kept that the prefix cache did not hold before
    logprobs: int | None = None
    matcher: xgrammar.GrammarMatcher | None = None  # a structured-output request's grammar state
    guard: AnswerGuard | None = None  # a JSON or tool-call answer's repeats and lengths
    thinking: ThinkingReader | None = None  # a reasoning model's thinking, before the answer its grammar holds
    embed: bool = False  # its prompt's embedding is its outcome: it ends when its prefill does
    adapter_slot: int | None = None  # the LoRA adapter slot its rows run with (None: the base model)
    on_finished: Callable[[], None] | None = None  # gives back what it held (its adapter slot) once it ends
    state: TaskState = TaskState.WAITING
    num_computed: int = 0
    admitted_once: bool = False
    tiers_asked: bool = False  # the KV tiers were asked for its prompt's pages since it last waited
    submitted_at: float = field(default_factory=time.monotonic)
    loaded: LoadedPages | None = None  # pages the tiers gave it, until it is admitted
    drafts: list[int] = field(default_factory=list)  # tokens proposed for this step, verified after its forward
    speculation: TaskSpeculation | None = None  # its n-grams and how its proposals fared, once it has proposed
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at its first admission
    queue_time_s: float | None = None  # from submission to its first admission
    published: bool = False  # a delta has gone out

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def banned_token_ids(self) -> frozenset[int]:
        """What its next token may not be: its stop token ids while it is under `min_tokens`."""
        return self.stop_token_ids if self.num_output < self.min_tokens else frozenset()

    @property
    def active_matcher(self) -> xgrammar.GrammarMatcher | None:
        """Its grammar, once its thinking (if any) is over: a grammar holds the answer only."""
        return self.matcher if self.thinking is None or not self.thinking.open else None

    @property
    def forced_token(self) -> int | None:
        """The token its next step must take: `</think>` when its thinking has spent its budget, else the closing
        quote of a JSON string its guard has let run long enough (where the grammar allows it)."""
        if self.thinking is not None and self.thinking.open:
            return self.thinking.forced_token
        return self.guard.forced_token if self.guard is not None else None

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.num_tokens - 1

    @property
    def usage(self) -> Usage:
        thinking = self.thinking.reasoning_tokens if self.thinking is not None else 0
        return Usage(self.prompt_len, self.num_output, self.cached_tokens, self.cache_written_tokens, thinking)

    def admitted(self, cached_tokens: int) -> None:
        """Its first admission: how much of its prompt the cache held, and how long it waited."""
        self.cached_tokens = cached_tokens
        self.queue_time_s = time.monotonic() - self.submitted_at

    def publish(self, delta: StreamDelta) -> None:
        """Send a delta on: the first carries the usage so far and the queue time, the last the final usage."""
        if not self.published:
            self.published = True
            delta = replace(delta, usage=self.usage, queue_time_s=self.queue_time_s)
        elif delta.finish_reason is not None:
            delta = replace(delta, usage=self.usage)
        self.out(self.task_id, delta)

    def accept(self, token: int, max_model_len: int, logprob: TokenLogprob | None = None) -> StreamDelta:
        """Append a sampled token; return the text it adds and, when it ends the task, why.

        A structured-output task whose grammar has just ended stops here, `ignore_eos` or not; so does one
        whose guard ends it (a repeated call, its constrained tokens spent). Thinking text goes out as
        reasoning, past the grammar, the guard and the stop strings, which hold the answer.
        """
        thinking = self.thinking
        was_thinking = thinking is not None and thinking.open
        phase = thinking.accept(token) if thinking is not None else "answer"
        reads = phase == "answer" or (phase == "tag" and thinking is not None and thinking.grammar_reads_tags)
        matcher = self.matcher if reads else None
        if matcher is not None and not matcher.accept_token(token):
            return StreamDelta("", (), "error", error=f"token {token} was sampled outside the request's grammar")
        self.tokens.append(token)
        logprobs = (logprob,) if logprob is not None else ()
        if matcher is not None and matcher.is_terminated():
            return self.closing_delta("stop", (token,), logprobs=logprobs)
        if token in self.stop_token_ids:
            return self.closing_delta("stop", (token,), logprobs=logprobs)
        if phase == "thinking" or (phase == "tag" and was_thinking):
            return self._thinking_delta(phase, token, max_model_len, logprobs)
        if phase == "tag":  # what the detokenizer held is the answer's, the tag is neither's
            piece = self.detokenizer.flush()
            self.detokenizer.skip(token)
        else:
            piece = self.detokenizer.push(token)
        if self.guard is not None and (reason := self.guard.after(piece)) is not None:
            return self.closing_delta(reason, (token,), self.stop_strings.feed(piece), logprobs)
        stops = self.stop_strings
        text = stops.pass_through(piece) if self.num_output < self.min_tokens else stops.feed(piece)
        if self.stop_strings.matched is not None:
            return StreamDelta(text, (token,), "stop", logprobs, stop_string=self.stop_strings.matched)
        if self.num_output >= self.max_tokens or self.num_tokens >= max_model_len:
            return self.closing_delta("length", (token,), text, logprobs)
        return StreamDelta(text, (token,), logprobs=logprobs)

    def _thinking_delta(
        self, phase: str, token: int, max_model_len: int, logprobs: tuple[TokenLogprob, ...]
    ) -> StreamDelta:
        """The reasoning a thinking token adds; a tag that ends the thinking adds none (what the detokenizer held
        goes out before it)."""
        if phase == "tag":
            reasoning = self.detokenizer.flush()
            self.detokenizer.skip(token)
        else:
            reasoning = self.detokenizer.push(token)
        if self.num_output >= self.max_tokens or self.num_tokens >= max_model_len:
            closing = self.closing_delta("length", (token,), logprobs=logprobs)
            return replace(closing, reasoning=reasoning + closing.reasoning)
        return StreamDelta("", (token,), logprobs=logprobs, reasoning=reasoning)

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
