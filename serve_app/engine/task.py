"""Task: the scheduler's state for one request, from waiting through running to finished: its tokens and how far
the cache has them, and its parts -- how its tokens are chosen (`TaskSampling`), how it gets into the cache
(`TaskAdmission`), its adapter, its speculation, and its way out (`TaskOutput`)."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from serve_app.engine.speculation import TaskSpeculation
from serve_app.engine.task_output import TaskOutput
from serve_app.kv.tiers.pages import LoadedPages
from serve_app.wire.outputs import CoreOutput, SampledLogprob, Usage
from serve_app.wire.requests import SamplingParams

if TYPE_CHECKING:
    import xgrammar


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
class TaskSampling:
    """How its tokens are chosen: the sampling parameters (with a seeded generator), its grammar, the stop token ids
    (kept out under `min_tokens`), and how many logprobs it reports."""

    params: SamplingParams
    stop_token_ids: frozenset[int]
    min_tokens: int = 0  # before this many output tokens, no stop token id may be chosen nor a stop string end it
    generator: torch.Generator | None = None
    matcher: xgrammar.GrammarMatcher | None = None  # a structured-output request's grammar state
    logprobs: int | None = None


@dataclass
class TaskAdmission:
    """How it gets into the cache, and when: the salt its prompt's pages are keyed under, its place in the waiting
    order, its prompt-caching pin, what the prefix cache and the KV tiers gave it."""

    prefix_salt: str  # the tenant's salt, and the adapter's
    priority: int = 0  # lower is admitted first, under the priority scheduling policy
    pin: CachePin | None = None  # its prompt's prefix to keep cached, until its prefill has computed it
    background: bool = False  # a batch's: admitted after, preempted before, and prefilled around online tasks
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at its first admission
    cache_written_tokens: int = 0  # prompt tokens its pin kept that the prefix cache did not hold before
    loaded: LoadedPages | None = None  # pages the tiers gave it, until it is admitted
    tiers_asked: bool = False  # the KV tiers were asked for its prompt's pages since it last waited
    admitted_once: bool = False
    submitted_at: float = field(default_factory=time.monotonic)
    queue_time_s: float | None = None  # from submission to its first admission


@dataclass(frozen=True)
class AdapterHold:
    """The LoRA adapter slot its rows run with, and how to give it back once it ends."""

    slot: int
    release: Callable[[], None]


@dataclass
class Task:
    """Token ids so far (`tokens` = prompt + output), how many have k/v in the cache, and its parts."""

    task_id: int
    prompt_len: int
    tokens: list[int]
    max_tokens: int
    sampling: TaskSampling
    output: TaskOutput
    admission: TaskAdmission
    adapter: AdapterHold | None = None  # None: the base model
    state: TaskState = TaskState.WAITING
    num_computed: int = 0
    drafts: list[int] = field(default_factory=list)  # tokens proposed for this step, verified after its forward
    speculation: TaskSpeculation | None = None  # its n-grams and how its proposals fared, once it has proposed

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
    def adapter_slot(self) -> int | None:
        return self.adapter.slot if self.adapter is not None else None

    @property
    def banned_token_ids(self) -> frozenset[int]:
        """What its next token may not be: its stop token ids while it is under `min_tokens`."""
        sampling = self.sampling
        return sampling.stop_token_ids if self.num_output < sampling.min_tokens else frozenset()

    @property
    def active_matcher(self) -> xgrammar.GrammarMatcher | None:
        """Its grammar, once its thinking (if any) is over: a grammar holds the answer only."""
        thinking = self.output.thinking
        return self.sampling.matcher if thinking is None or not thinking.open else None

    @property
    def forced_token(self) -> int | None:
        """The token its next step must take: `</think>` when its thinking has spent its budget, else the closing
        quote of a JSON string its guard has let run long enough (where the grammar allows it)."""
        thinking, guard = self.output.thinking, self.output.guard
        if thinking is not None and thinking.open:
            return thinking.forced_token
        return guard.forced_token if guard is not None else None

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.num_tokens - 1

    @property
    def usage(self) -> Usage:
        thinking = self.output.thinking
        admission = self.admission
        reasoning = thinking.reasoning_tokens if thinking is not None else 0
        return Usage(self.prompt_len, self.num_output, admission.cached_tokens, admission.cache_written_tokens, reasoning)

    def admitted(self, cached_tokens: int) -> None:
        """Its first admission: how much of its prompt the cache held, and how long it waited."""
        self.admission.cached_tokens = cached_tokens
        self.admission.queue_time_s = time.monotonic() - self.admission.submitted_at

    def release(self) -> None:
        """Give back what it held (its adapter slot) once it ends."""
        if self.adapter is not None:
            self.adapter.release()

    def publish(self, output: CoreOutput) -> None:
        """Send an output on (the first with the usage so far and the queue time, the last with the final usage)."""
        self.output.publish(self.task_id, output, self.usage, self.admission.queue_time_s)

    def accept(self, token: int, max_model_len: int, logprob: SampledLogprob | None = None) -> CoreOutput:
        """Append a sampled token; return it with what it is part of and, when it ends the task, why.

        A structured-output task whose grammar has just ended stops here, `ignore_eos` or not; so does one
        whose guard ends it (a repeated call, its constrained tokens spent). Thinking goes out as such, past the
        grammar and the guard, which hold the answer.
        """
        thinking, sampling = self.output.thinking, self.sampling
        was_thinking = thinking is not None and thinking.open
        phase = thinking.accept(token) if thinking is not None else "answer"
        reads = phase == "answer" or (phase == "tag" and thinking is not None and thinking.grammar_reads_tags)
        matcher = sampling.matcher if reads else None
        if matcher is not None and not matcher.accept_token(token):
            return CoreOutput((), (), "error", error=f"token {token} was sampled outside the request's grammar")
        self.tokens.append(token)
        logprobs = (logprob,) if logprob is not None else ()
        if (matcher is not None and matcher.is_terminated()) or token in sampling.stop_token_ids:
            return CoreOutput((token,), ("end",), "stop", logprobs)
        at_limit = self.num_output >= self.max_tokens or self.num_tokens >= max_model_len
        return self.output.token(token, phase, was_thinking, logprobs, at_limit)
