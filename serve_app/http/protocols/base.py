"""The protocol strategy: a `ResponseBuilder` per API reads a request and makes its `ResponseFormatter` (the
answer's shape and the state it keeps as it streams); `ProtocolHandler` runs one request with them."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

from opentelemetry.trace import StatusCode
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response

from serve_app.http.engine_client import EngineClient
from serve_app.http.protocols.errors import ErrorFormat, ProtocolError
from serve_app.http.protocols.fields import from_validation_error
from serve_app.http.protocols.limits import RequestLimits
from serve_app.http.protocols.prepared import Choice, PreparedRequest
from serve_app.http.streaming import ClosingStreamingResponse
from serve_app.metrics import tracing
from serve_app.metrics.catalog import RequestTiming
from serve_app.wire.model_card import ModelInfo
from serve_app.wire.outputs import StreamDelta

logger = logging.getLogger(__name__)

DEFAULT_LIMITS = RequestLimits()


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event}\ndata: {payload}\n\n" if event else f"data: {payload}\n\n"


class ResponseFormatter(ABC):
    """One request's answer in its API's shape: its events as the choices stream, or its whole body. Made by
    the builder's `prepare` for each request, it keeps what the answer needs as it goes, typed by the API."""

    def __init__(self, prepared: PreparedRequest) -> None:
        self.prepared = prepared

    @abstractmethod
    def stream_start(self, choices: Sequence[Choice]) -> list[str]:
        """Events before the first text (the first delta of every choice is already in `choices`)."""

    @abstractmethod
    def chunk(self, choice: Choice, delta: StreamDelta) -> list[str]:
        """The events one delta of `choice` makes (`choice` has it already)."""

    @abstractmethod
    def stream_end(self, choices: Sequence[Choice]) -> list[str]: ...

    @abstractmethod
    def response(self, choices: Sequence[Choice]) -> dict[str, Any]: ...


class ResponseBuilder(ABC):
    """One API's request parsing and error shape. Adding a protocol is one builder and its formatter."""

    errors: ErrorFormat  # how this API writes an error
    # The names this API gives its stop sequences, its output-token limit and its conversation, for errors.
    stop_param = "stop"
    max_tokens_param = "max_tokens"
    messages_param = "messages"
    prompt_param = "prompt"  # its prompt as text or token ids (legacy completions' name)

    @abstractmethod
    def prepare(self, body: Any, model: ModelInfo, limits: RequestLimits = DEFAULT_LIMITS) -> ResponseFormatter:
        """Validate the JSON body (ProtocolError naming the field on bad input); the request's formatter. Its
        choices are held to `limits` before a request is made for each."""


# Runs once the answer is whole (given its formatter), before the client has all of it.
Answered = Callable[[ResponseFormatter], Awaitable[None]]


class RequestObserver(Protocol):
    """Told about each request's timing and outcome (the server's metrics, `ServerMetrics`)."""

    def on_finish(self, model_name: str, timing: RequestTiming, reason: str, prompt_tokens: int, output_tokens: int) -> None:
        """One choice has ended for `reason` (a finish reason, `cancelled` where it has none)."""


class ProtocolHandler:
    """Runs one request: prepare, start the engine streams, then stream events or build the response."""

    def __init__(self, builder: ResponseBuilder, engine: EngineClient, observer: RequestObserver | None = None) -> None:
        self.builder = builder
        self.engine = engine
        self.observer = observer
        self.model_name = ""  # the served model's id, once the request is prepared
        self.span = tracing.tracer().start_span("ingress", attributes={"serve_app.api": type(builder).__name__})

    async def handle(
        self,
        body: Any,
        tenant_salt: Callable[[str | None], str] | None = None,
        limits: RequestLimits | None = None,
        answered: Answered | None = None,
        background: bool = False,
    ) -> Response:
        """Answer one request: prepare it, hold it to `limits`, encode it (the chat template, tokens, and the engine
        salt `tenant_salt` maps each client salt to), then stream it from the engine.
        `answered` runs once the whole answer is built, before its last event or the response is sent
        (a client that has the answer can rely on what `answered` did; where it fails, the client gets the
        protocol's error instead: a 500, or a stream that ends in its error event). A `background` request (a
        batch's) runs in what online requests leave over."""
        try:
            if not await self.engine.ready():
                raise ProtocolError("not_ready", "Engine not initialized")
            info = await self.engine.model_info()
            self.model_name = info.id
            limits = limits or DEFAULT_LIMITS
            # Validating a big body takes a while: off the event loop, which serves every other request.
            formatter = await asyncio.to_thread(self.builder.prepare, body, info, limits)
            prepared = formatter.prepared
            if prepared.end_user is not None:
                self.span.set_attribute("enduser.id", prepared.end_user)
            builder = self.builder
            limits.apply(
                prepared, info, builder.stop_param, builder.max_tokens_param, builder.messages_param, builder.prompt_param
            )
            salts = [tenant_salt(r.client_salt) if tenant_salt is not None else r.client_salt or "" for r in prepared.requests]
            encoded = await self.engine.prompts.encode(
                prepared.requests, salts, tracing.carrier(self.span), prepared.choices_per_prompt
            )
            if background:
                encoded = [dataclasses.replace(request, background=True) for request in encoded]
            streams = [_TimedStream(self.engine.stream(r)) for r in encoded]
            firsts = await _first_deltas(streams)
        except ValidationError as error:
            return self._refuse(from_validation_error(error))
        except ProtocolError as error:
            return self._refuse(error)
        except BaseException:
            self.span.set_status(StatusCode.ERROR)
            self.span.end()
            raise
        choices = [Choice(index=i) for i in range(len(streams))]
        for choice, first in zip(choices, firsts):
            choice.add(first)
        if prepared.stream:
            events = self._events(formatter, streams, choices, firsts, answered)
            return ClosingStreamingResponse(events, [lambda: self._finish(streams, choices)])
        try:
            await _drain(streams, choices)
        finally:
            await self._finish(streams, choices)
        failed = next((c for c in choices if c.finish_reason == "error"), None)
        if failed is not None:
            return self.builder.errors.response(ProtocolError("internal", failed.error or "generation failed"))
        response = formatter.response(choices)
        if answered is not None:
            await answered(formatter)
        return JSONResponse(response)

    async def _events(
        self,
        formatter: ResponseFormatter,
        streams: list[_TimedStream],
        choices: list[Choice],
        firsts: list[StreamDelta],
        answered: Answered | None,
    ) -> AsyncIterator[str]:
        """The stream's events; its engine streams are closed by the response (`_finish`), however it ends."""
        for event in formatter.stream_start(choices):
            yield event
        for choice, first in zip(choices, firsts):
            for event in formatter.chunk(choice, first):
                yield event
        async for index, delta in _merged(streams, choices):
            choice = choices[index]
            choice.add(delta)
            for event in formatter.chunk(choice, delta):
                yield event
        end = formatter.stream_end(choices)
        if answered is not None:
            try:
                await answered(formatter)
            except Exception:  # e.g. the response store gone: the stream ends in the protocol's error
                logger.exception("a streamed answer was built but what follows it failed")
                for choice in choices:
                    choice.finish_reason, choice.error = "error", "the answer was built but could not be kept"
                end = formatter.stream_end(choices)
        for event in end:
            yield event

    def _refuse(self, error: ProtocolError) -> Response:
        self.span.set_status(StatusCode.ERROR, error.message)
        self.span.end()
        return self.builder.errors.response(error)

    async def _finish(self, streams: Sequence[_TimedStream], choices: Sequence[Choice]) -> None:
        """Close the engine streams (cancelling what is unfinished), tell the observer how each went, end the span."""
        await _close(streams)
        if self.observer is not None:
            for stream, choice in zip(streams, choices):
                prompt_tokens = choice.usage.prompt_tokens if choice.usage is not None else 0
                reason = choice.finish_reason or "cancelled"
                self.observer.on_finish(self.model_name, stream.timing(), reason, prompt_tokens, len(choice.token_ids))
        span = self.span
        span.set_attribute("gen_ai.request.model", self.model_name)
        span.set_attribute("gen_ai.response.finish_reasons", [c.finish_reason or "cancelled" for c in choices])
        span.set_attribute("gen_ai.usage.output_tokens", sum(len(c.token_ids) for c in choices))
        if choices and choices[0].usage is not None:
            span.set_attribute("gen_ai.usage.input_tokens", choices[0].usage.prompt_tokens)
        if streams and streams[0].ttft is not None:
            span.set_attribute("serve_app.time_to_first_token_s", streams[0].ttft)
        if any(c.finish_reason == "error" for c in choices):
            span.set_status(StatusCode.ERROR)
        span.end()


class _TimedStream:
    """An engine stream that remembers when its token-carrying deltas arrived, and when it ended."""

    def __init__(self, stream: AsyncIterator[StreamDelta]) -> None:
        self.stream = stream
        self.start = time.perf_counter()
        self.ttft: float | None = None
        self.gaps: list[float] = []
        self.queue_time: float | None = None
        self.e2e: float | None = None
        self._last = 0.0

    def timing(self) -> RequestTiming:
        return RequestTiming(self.ttft, tuple(self.gaps), self.queue_time, self.e2e)

    async def next(self) -> StreamDelta:
        delta = await self.stream.__anext__()
        now = time.perf_counter()
        if delta.queue_time_s is not None:
            self.queue_time = delta.queue_time_s
        if delta.finish_reason is not None:
            self.e2e = now - self.start
        if delta.token_ids:
            if self.ttft is None:
                self.ttft = now - self.start
            else:
                # A merged delta of k tokens spreads its gap over them.
                gap = (now - self._last) / len(delta.token_ids)
                self.gaps.extend([gap] * len(delta.token_ids))
            self._last = now
        return delta

    async def aclose(self) -> None:
        closer = getattr(self.stream, "aclose", None)
        if closer is not None:
            await closer()


async def _first_deltas(streams: Sequence[_TimedStream]) -> list[StreamDelta]:
    """Every stream's first delta; a refused request closes all of them and raises."""
    results = await asyncio.gather(*(s.next() for s in streams), return_exceptions=True)
    error = next((r for r in results if isinstance(r, BaseException)), None)
    if error is not None:
        await _close(streams)
        if isinstance(error, StopAsyncIteration):
            raise ProtocolError("internal", "the engine closed the stream without output")
        raise error
    return list(results)  # type: ignore[arg-type]


async def _merged(streams: Sequence[_TimedStream], choices: Sequence[Choice]) -> AsyncIterator[tuple[int, StreamDelta]]:
    """(choice index, delta) from every unfinished stream, in arrival order."""
    live = [i for i, c in enumerate(choices) if c.finish_reason is None]
    if len(live) == 1:
        index = live[0]
        while True:
            delta = await streams[index].next()
            yield index, delta
            if delta.finish_reason is not None:
                return
    pending = {asyncio.ensure_future(streams[i].next()): i for i in live}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                index = pending.pop(future)
                delta = future.result()
                yield index, delta
                if delta.finish_reason is None:
                    pending[asyncio.ensure_future(streams[index].next())] = index
    finally:
        for future in pending:
            future.cancel()


async def _drain(streams: Sequence[_TimedStream], choices: list[Choice]) -> None:
    async for index, delta in _merged(streams, choices):
        choices[index].add(delta)


async def _close(streams: Sequence[_TimedStream]) -> None:
    for stream in streams:
        try:
            await stream.aclose()
        except Exception:  # closing is best effort: the stream may already be gone
            pass
