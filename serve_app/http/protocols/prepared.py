"""What a protocol's builder makes of a request (`PreparedRequest`: the engine requests, one per choice, and what
every API's answer carries), and each choice's output as it accumulates (`Choice`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from serve_app.wire.outputs import StreamDelta, TokenLogprob, Usage
from serve_app.wire.requests import GenerateRequest


@dataclass
class PreparedRequest:
    """A validated protocol request: the engine requests (one per choice) and what every answer needs; what one
    API's answer needs besides is its formatter's."""

    requests: list[GenerateRequest]
    stream: bool
    model: str
    choices_per_prompt: int = 1
    include_usage: bool = False
    end_user: str | None = None  # the API's user or safety identifier, recorded on the request's span
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class Choice:
    """One choice's output as it accumulates."""

    index: int
    text: str = ""
    reasoning: str = ""  # a reasoning model's thinking, apart from its answer `text`
    embedding: tuple[float, ...] | None = None  # an embedding request's
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_string: str | None = None
    usage: Usage | None = None
    error: str | None = None

    @property
    def complete(self) -> bool:
        """Whether it ended where the model or its grammar ended it (not cut by a token limit or a stop sequence)."""
        return self.finish_reason == "stop" and self.stop_string is None

    def add(self, delta: StreamDelta) -> None:
        self.text += delta.text
        self.reasoning += delta.reasoning
        if delta.embedding is not None:
            self.embedding = delta.embedding
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.usage is not None:
            self.usage = delta.usage
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_string = delta.stop_string
            self.error = delta.error


def total_usage(prepared: PreparedRequest, choices: Sequence[Choice]) -> Usage:
    """Usage over all choices: each prompt counted once, completions summed."""
    prompt = cached = written = completion = reasoning = 0
    for choice in choices:
        usage = choice.usage or Usage(0, 0, 0)
        if choice.index % prepared.choices_per_prompt == 0:
            prompt += usage.prompt_tokens
            cached += usage.cached_tokens
            written += usage.cache_written_tokens
        completion += len(choice.token_ids)
        reasoning += usage.reasoning_tokens
    return Usage(prompt, completion, cached, written, reasoning)
