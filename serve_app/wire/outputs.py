"""What comes back from an engine for a request: the core's outputs of token ids (`CoreOutput`, one per request and
step), the deltas of text, reasoning and token ids they become (`StreamDelta`), logprobs, the finish reason, the
usage, and the whole outcome (`RequestOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

FinishReason = Literal["stop", "length", "cancelled", "error"]

# What an output token is part of: the answer, the thinking, a marker of the thinking (a tag or a channel's header:
# no text of its own), or the end (a stop token id, or the token that completed a grammar: no text either).
TokenRole = Literal["answer", "thinking", "tag", "end"]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # of the prompt, found in the prefix cache
    cache_written_tokens: int = 0  # of the prompt, not found there but kept there for its breakpoint's TTL
    reasoning_tokens: int = 0  # of the completion, the thinking's (its tags included)


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model, and the most likely tokens at its position."""

    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()


@dataclass(frozen=True)
class SampledLogprob:
    """A sampled token's log-probability and the most likely tokens at its position, as the core has them: ids."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class CoreOutput:
    """One request's new tokens from one step of the engine core, with what each is part of (`roles`, one per token);
    the last has a finish reason. The first and the last carry the usage, and so does every one after the thinking's
    count changed. An output processor makes text of them (`StreamDelta`)."""

    token_ids: tuple[int, ...]
    roles: tuple[TokenRole, ...]
    finish_reason: FinishReason | None = None
    logprobs: tuple[SampledLogprob, ...] = ()
    usage: Usage | None = None
    error: str | None = None
    queue_time_s: float | None = None  # on the first: how long the request waited to be admitted
    embedding: tuple[float, ...] | None = None  # an `embed` request's (its only output)


def merge_outputs(outputs: list[CoreOutput]) -> CoreOutput:
    """Several consecutive outputs of one request as one (the positions of one step's proposals)."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    return replace(
        last,
        token_ids=tuple(t for o in outputs for t in o.token_ids),
        roles=tuple(r for o in outputs for r in o.roles),
        logprobs=tuple(lp for o in outputs for lp in o.logprobs),
        usage=last.usage or next((o.usage for o in reversed(outputs) if o.usage is not None), None),
        queue_time_s=next((o.queue_time_s for o in outputs if o.queue_time_s is not None), None),
    )


@dataclass(frozen=True)
class StreamDelta:
    """New text and token ids for one request. The last delta has a finish reason and the usage."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    stop_string: str | None = None
    usage: Usage | None = None
    error: str | None = None
    queue_time_s: float | None = None  # on the first delta: how long the request waited to be admitted
    reasoning: str = ""  # new thinking text, apart from the answer's `text` (an engine with a reasoning_parser)
    embedding: tuple[float, ...] | None = None  # an `embed` request's (its only delta)


def merge_deltas(deltas: list[StreamDelta]) -> StreamDelta:
    """Several consecutive deltas as one (for a consumer that fell behind)."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    return replace(
        last,
        text="".join(d.text for d in deltas),
        reasoning="".join(d.reasoning for d in deltas),
        token_ids=tuple(t for d in deltas for t in d.token_ids),
        logprobs=tuple(lp for d in deltas for lp in d.logprobs),
        usage=last.usage or next((d.usage for d in deltas if d.usage is not None), None),
        queue_time_s=next((d.queue_time_s for d in deltas if d.queue_time_s is not None), None),
    )


@dataclass(frozen=True)
class RequestOutput:
    """What a finished request amounted to, for a caller that waited for all of it (its deltas as one)."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    reasoning: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stop_string: str | None = None
    error: str | None = None
    queue_time_s: float | None = None
    embedding: tuple[float, ...] | None = None

    @classmethod
    def of(cls, delta: StreamDelta) -> RequestOutput:
        """The outcome a request's deltas, merged into `delta`, amount to (its last carries the finish reason; a
        request its engine lost before any usage came counts only the tokens it had)."""
        assert delta.finish_reason is not None, "a request's deltas without their last"
        usage = delta.usage or Usage(0, len(delta.token_ids), 0)
        return cls(
            delta.text, list(delta.token_ids), delta.finish_reason, usage, delta.reasoning, list(delta.logprobs),
            delta.stop_string, delta.error, delta.queue_time_s, delta.embedding,
        )

    @property
    def cached_tokens(self) -> int:
        return self.usage.cached_tokens
