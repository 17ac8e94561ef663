"""The engine's synchronous and simple asyncio API, for callers in process: `generate` (text or a batch, whole
or streamed), `generate_with_request` (ready-made requests), `generate_async`. Each request is submitted to
the engine as any other, and its text read from its `DeltaStream`."""

from __future__ import annotations

import queue
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from serve_app.engine.delta_stream import DeltaListener, DeltaStream
from serve_app.wire.outputs import RequestOutput, StreamDelta
from serve_app.wire.requests import GenerateRequest

Prompt = str | list[int]


class Conveniences:
    """Mixed into `InferenceEngine`: everything here goes through its `submit`."""

    if TYPE_CHECKING:  # InferenceEngine's own

        def submit(self, request: GenerateRequest, listener: DeltaListener | None = None) -> DeltaStream: ...

    def generate(self, prompt: Prompt | Sequence[Prompt], stream: bool = False, **params: Any):
        """`str -> str`, `list -> list[str]`; with `stream=True`, deltas (`str`, or `(index, str)` for a list)."""
        if _is_batch(prompt):
            requests = [GenerateRequest(prompt=p, **params) for p in prompt]
        else:
            requests = GenerateRequest(prompt=prompt, **params)
        return self.generate_with_request(requests, stream=stream)

    def generate_with_request(self, request: GenerateRequest | Sequence[GenerateRequest], stream: bool = False):
        """As `generate`, for ready-made requests (chat messages too)."""
        if isinstance(request, GenerateRequest):
            deltas = self.submit(request)
            return _text_stream(deltas) if stream else _text_of(deltas.wait())
        if stream:
            return self._indexed_stream(request)
        return [_text_of(s.wait()) for s in self._submit_all(request)]

    def _submit_all(self, requests: Sequence[GenerateRequest], listener=lambda index: None) -> list[DeltaStream]:
        streams: list[DeltaStream] = []
        try:
            for index, request in enumerate(requests):
                streams.append(self.submit(request, listener(index)))
        except Exception:
            for stream in streams:
                stream.close()
            raise
        return streams

    def _indexed_stream(self, requests: Sequence[GenerateRequest]) -> Iterator[tuple[int, str]]:
        """Deltas of several requests as they arrive, each tagged with its request's index."""
        events: queue.SimpleQueue[tuple[int, StreamDelta]] = queue.SimpleQueue()
        streams = self._submit_all(requests, lambda index: lambda delta: events.put((index, delta)))
        remaining = len(streams)
        failures: list[StreamDelta] = []
        try:
            while remaining:
                index, delta = events.get()
                if delta.text:
                    yield index, delta.text
                if delta.finish_reason is not None:
                    remaining -= 1
                    failures += [delta] if delta.finish_reason == "error" else []
        finally:
            for stream in streams:
                stream.close()
        for failure in failures:
            _text_of(failure)

    async def generate_async(self, prompt: Prompt | GenerateRequest, **params: Any) -> AsyncIterator[str]:
        """Text deltas for one request, for asyncio callers."""
        request = prompt if isinstance(prompt, GenerateRequest) else GenerateRequest(prompt=prompt, **params)
        deltas = self.submit(request)
        try:
            async for delta in deltas:
                if delta.text:
                    yield delta.text
                _text_of(delta)
        finally:
            deltas.close()


def _is_batch(prompt: Any) -> bool:
    """A list of prompts, as opposed to one prompt given as a list of token ids."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and not isinstance(prompt[0], int)


def _text_stream(deltas: DeltaStream) -> Iterator[str]:
    for delta in deltas:
        if delta.text:
            yield delta.text
        _text_of(delta)


def _text_of(delta: StreamDelta | RequestOutput) -> str:
    """Its text; raises for one that ends its request with an error."""
    if delta.finish_reason == "error":
        raise RuntimeError(delta.error or "the request failed")
    return delta.text
