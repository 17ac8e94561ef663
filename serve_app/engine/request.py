"""GenerateRequest (what a caller asks for) and GenerateResult (what comes back, whole or streamed)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serve_app.engine.sampling_params import SamplingParams
from serve_app.engine.structured_output import StructuredOutput

FinishReason = Literal["stop", "length", "cancelled", "error"]


class GenerateRequest(BaseModel):
    """One generation: a prompt (text or token ids) or chat messages, sampling and stop settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = Field(
        None, description="function tools (OpenAI's shape) for a chat template that takes them; with messages only"
    )
    max_tokens: int | None = Field(16, ge=1, description="None: up to the end of the model's context")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    cache_salt: str = ""
    trace_context: dict[str, str] = Field(
        default_factory=dict, description="the W3C trace context (traceparent) of the span that asked, where tracing is on"
    )
    lora: str | None = Field(None, description="the LoRA adapter to run with (named in lora_paths, or a folder under dynamic_lora_loading_path)")
    logprobs: int | None = Field(None, ge=0, le=20, description="also return each token's logprob and this many top ones")
    structured_output: StructuredOutput | None = Field(None, description="what the output must match, enforced per token")
    max_string_tokens: int | None = Field(
        None, ge=1,
        description="a JSON string of the answer is closed after this many tokens, where its grammar lets it end "
        "(a JSON or tool-call answer only)",
    )
    max_constrained_tokens: int | None = Field(
        None, ge=1,
        description="the answer ends (length) after this many tokens inside its constrained JSON: its calls, "
        "or the whole of a JSON answer (a JSON or tool-call answer only)",
    )

    @model_validator(mode="before")
    @classmethod
    def _flat_sampling_fields(cls, data: Any) -> Any:
        """`GenerateRequest(prompt=..., temperature=0)`: sampling fields given flat go into `sampling`."""
        if not isinstance(data, dict):
            return data
        flat = {key: data[key] for key in SamplingParams.model_fields if key in data}
        if not flat:
            return data
        if "sampling" in data:
            raise ValueError(f"give the sampling fields in `sampling` or flat, not both ({', '.join(flat)})")
        rest = {key: value for key, value in data.items() if key not in flat}
        return {**rest, "sampling": flat}

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else ([] if value is None else value)

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: str | list[int] | None) -> str | list[int] | None:
        if value is not None and len(value) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and any(token < 0 for token in value):
            raise ValueError("prompt token ids must be >= 0")
        return value

    @field_validator("messages")
    @classmethod
    def _messages_not_empty(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if value is not None:
            if not value:
                raise ValueError("messages must not be empty")
            for index, message in enumerate(value):
                if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                    raise ValueError(f"messages[{index}] needs a string 'role' and a string 'content'")
        return value

    @property
    def prefix_salt(self) -> str:
        """The salt its prompt's pages are cached under: KV made under one adapter is never another's (or
        the base model's), so the adapter is part of it. The engine and the request router both use it."""
        return self.cache_salt if self.lora is None else f"{self.cache_salt}\x00lora:{self.lora}"

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt or messages: give exactly one")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools: give them with messages")
        return self


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


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


def merge_deltas(deltas: list[StreamDelta]) -> StreamDelta:
    """Several consecutive deltas as one (for a consumer that fell behind)."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    return replace(
        last,
        text="".join(d.text for d in deltas),
        token_ids=tuple(t for d in deltas for t in d.token_ids),
        logprobs=tuple(lp for d in deltas for lp in d.logprobs),
        usage=last.usage or next((d.usage for d in deltas if d.usage is not None), None),
        queue_time_s=next((d.queue_time_s for d in deltas if d.queue_time_s is not None), None),
    )


@dataclass
class GenerateResult:
    """A request's outcome. The scheduler publishes deltas; callers wait (Condition) or stream (Event)."""

    task_id: int
    prompt_tokens: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    cached_tokens: int = 0
    queue_time_s: float | None = None
    stop_string: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    _deltas: list[StreamDelta] = field(default_factory=list, repr=False)
    _done: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _new_delta: threading.Event = field(default_factory=threading.Event, repr=False)
    _subscribers: list[Callable[[StreamDelta], None]] = field(default_factory=list, repr=False)
    _on_abandon: Callable[[int], None] | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, len(self.token_ids), self.cached_tokens)

    def publish(self, delta: StreamDelta) -> None:
        """Called by the scheduler thread: record a delta and wake every waiter.

        The first and the final delta (the one with a finish reason) carry the request's usage; the first
        its queue time too.
        """
        with self._done:
            self.text += delta.text
            self.token_ids.extend(delta.token_ids)
            self.logprobs.extend(delta.logprobs)
            if delta.finish_reason is not None:
                self.finish_reason = delta.finish_reason
                self.error = delta.error
                self.stop_string = delta.stop_string
            if not self._deltas:
                delta = replace(delta, usage=self.usage, queue_time_s=self.queue_time_s)
            elif delta.finish_reason is not None:
                delta = replace(delta, usage=self.usage)
            self._deltas.append(delta)
            self._new_delta.set()
            self._done.notify_all()
            for notify in self._subscribers:
                notify(delta)

    def subscribe(self, notify: Callable[[StreamDelta], None]) -> None:
        """Call `notify(delta)` for every delta so far and every later one, in order.

        `notify` runs under the result's lock (on the scheduler thread for new deltas): keep it tiny.
        """
        with self._done:
            for delta in self._deltas:
                notify(delta)
            self._subscribers.append(notify)

    def unsubscribe(self, notify: Callable[[StreamDelta], None]) -> None:
        with self._done:
            self._subscribers.remove(notify)

    def set_cached_tokens(self, count: int) -> None:
        with self._done:
            self.cached_tokens = count

    def set_queue_time(self, seconds: float) -> None:
        """How long the request waited from submission to its first admission."""
        with self._done:
            self.queue_time_s = seconds

    def wait(self, timeout: float | None = None) -> GenerateResult:
        """Block until the request has finished; raise TimeoutError after `timeout` seconds."""
        with self._done:
            if not self._done.wait_for(lambda: self.finished, timeout):
                raise TimeoutError(f"task {self.task_id} did not finish within {timeout} s")
        return self

    def _take(self, start: int) -> tuple[list[StreamDelta], bool]:
        with self._done:
            items = self._deltas[start:]
            if not self.finished:
                self._new_delta.clear()
            return items, self.finished

    def stream(self) -> Iterator[StreamDelta]:
        """Deltas as they come. Closing the iterator early cancels the request."""
        seen = 0
        finished = False
        try:
            while not finished:
                self._new_delta.wait()
                items, finished = self._take(seen)
                seen += len(items)
                yield from items
        finally:
            if not finished and self._on_abandon is not None:
                self._on_abandon(self.task_id)

    async def astream(self, coalesce: bool = False) -> AsyncIterator[StreamDelta]:
        """Deltas as they come, for asyncio. Cancelling or closing it early cancels the request.

        With `coalesce`, deltas that piled up while the consumer was busy arrive as one.
        """
        loop = asyncio.get_running_loop()
        event = asyncio.Event()

        def notify(_: StreamDelta) -> None:
            loop.call_soon_threadsafe(event.set)

        self.subscribe(notify)
        seen = 0
        finished = False
        try:
            while True:
                items, finished = self._take(seen)
                seen += len(items)
                if coalesce and len(items) > 1:
                    items = [merge_deltas(items)]
                for item in items:
                    yield item
                if finished:
                    return
                await event.wait()
                event.clear()
        finally:
            self.unsubscribe(notify)
            if not finished and self._on_abandon is not None:
                self._on_abandon(self.task_id)
