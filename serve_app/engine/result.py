"""GenerateResult: one request's outcome in the engine's process, whole or streamed as it is published."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from serve_app.wire.outputs import FinishReason, StreamDelta, TokenLogprob, Usage, merge_deltas


@dataclass
class GenerateResult:
    """A request's outcome. The scheduler publishes deltas; callers wait (Condition) or stream (Event)."""

    task_id: int
    prompt_tokens: int
    text: str = ""
    reasoning: str = ""  # the thinking, apart from the answer's `text` (an engine with a reasoning_parser)
    embedding: tuple[float, ...] | None = None  # an `embed` request's
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    cached_tokens: int = 0
    cache_written_tokens: int = 0
    reasoning_tokens: int = 0
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
        return Usage(
            self.prompt_tokens, len(self.token_ids), self.cached_tokens, self.cache_written_tokens, self.reasoning_tokens
        )

    def publish(self, delta: StreamDelta) -> None:
        """Called by the scheduler thread: record a delta (the first and the last carry the usage, the first the
        queue time) and wake every waiter."""
        with self._done:
            self.text += delta.text
            self.reasoning += delta.reasoning
            if delta.embedding is not None:
                self.embedding = delta.embedding
            self.token_ids.extend(delta.token_ids)
            self.logprobs.extend(delta.logprobs)
            if delta.usage is not None:
                self.cached_tokens = delta.usage.cached_tokens
                self.cache_written_tokens = delta.usage.cache_written_tokens
                self.reasoning_tokens = delta.usage.reasoning_tokens
            if delta.queue_time_s is not None:
                self.queue_time_s = delta.queue_time_s
            if delta.finish_reason is not None:
                self.finish_reason = delta.finish_reason
                self.error = delta.error
                self.stop_string = delta.stop_string
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
