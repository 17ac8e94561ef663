"""What comes back from an engine for a request: deltas of text, reasoning and token ids, logprobs, the finish
reason and the usage."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

FinishReason = Literal["stop", "length", "cancelled", "error"]


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
