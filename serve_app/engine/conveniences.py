"""The engine's synchronous and simple asyncio API, for callers in process: `generate` (text or a batch, whole
or streamed), `generate_with_request` (ready-made requests), `generate_async`. Each request is submitted to
the engine as any other, and its text read from its `GenerateResult`."""

from __future__ import annotations

import queue
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from serve_app.engine.result import GenerateResult
from serve_app.wire.outputs import StreamDelta
from serve_app.wire.requests import GenerateRequest

Prompt = str | list[int]


class Conveniences:
    """Mixed into `InferenceEngine`: everything here goes through its `submit` and `abort`."""

    if TYPE_CHECKING:  # InferenceEngine's own

        def submit(self, request: GenerateRequest) -> GenerateResult: ...

        def abort(self, task_id: int) -> None: ...

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
            result = self.submit(request)
            return _text_stream(result) if stream else _text_of(result)
        results = self._submit_all(request)
        if stream:
            return _indexed_stream(results, self.abort)
        return [_text_of(r) for r in results]

    def _submit_all(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        results: list[GenerateResult] = []
        try:
            for request in requests:
                results.append(self.submit(request))
        except Exception:
            for result in results:
                self.abort(result.task_id)
            raise
        return results

    async def generate_async(self, prompt: Prompt | GenerateRequest, **params: Any) -> AsyncIterator[str]:
        """Text deltas for one request, for asyncio callers."""
        request = prompt if isinstance(prompt, GenerateRequest) else GenerateRequest(prompt=prompt, **params)
        result = self.submit(request)
        async for delta in result.astream():
            if delta.text:
                yield delta.text


def _is_batch(prompt: Any) -> bool:
    """A list of prompts, as opposed to one prompt given as a list of token ids."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and not isinstance(prompt[0], int)


def _text_stream(result: GenerateResult) -> Iterator[str]:
    for delta in result.stream():
        if delta.text:
            yield delta.text
    _raise_on_error(result)


def _indexed_stream(results: list[GenerateResult], abort: Callable[[int], None]) -> Iterator[tuple[int, str]]:
    """Deltas of several requests as they arrive, each tagged with its request's index."""
    events: queue.SimpleQueue[tuple[int, StreamDelta]] = queue.SimpleQueue()
    for index, result in enumerate(results):
        result.subscribe(lambda delta, index=index: events.put((index, delta)))
    remaining = len(results)
    try:
        while remaining:
            index, delta = events.get()
            if delta.text:
                yield index, delta.text
            if delta.finish_reason is not None:
                remaining -= 1
    finally:
        for result in results:
            if not result.finished:
                abort(result.task_id)
    for result in results:
        _raise_on_error(result)


def _text_of(result: GenerateResult) -> str:
    _raise_on_error(result.wait())
    return result.text


def _raise_on_error(result: GenerateResult) -> None:
    if result.finish_reason == "error":
        raise RuntimeError(result.error or f"task {result.task_id} failed")
