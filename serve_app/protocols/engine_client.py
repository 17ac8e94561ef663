"""Engine events across a process boundary, and the in-process `EngineClient`.

The engine side (`engine_events`) turns a refused request into a `RequestRefused` event, which
pickles through Ray streams; the client side (`deltas_from_events`) turns it back into a
`ProtocolError` before any delta.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from serve_app.engine import InferenceEngine
from serve_app.kv.transfer import CacheFullError, KVConfig, StoreResult
from serve_app.protocols.base import EngineClient, ModelInfo
from serve_app.protocols.errors import ErrorKind, ProtocolError
from serve_app.request import GenerateRequest, GenerateResult, InvalidRequestError, StreamDelta


class ServingEngine(Protocol):
    """What serving needs of an engine: `InferenceEngine` in process, or `EngineProcess` in its own."""

    max_model_len: int
    created: int

    async def submit_async(self, request: GenerateRequest) -> GenerateResult: ...
    def prompt_ids(self, request: GenerateRequest) -> list[int]: ...
    def kv_config(self) -> KVConfig: ...
    def kv_lookup(self, tokens: Sequence[int], cache_salt: str = "") -> int: ...
    def kv_retrieve(self, tokens: Sequence[int], cache_salt: str = "") -> torch.Tensor | None: ...
    def kv_store_chunks(self, kv: torch.Tensor, tokens: Sequence[int], cache_salt: str = "") -> StoreResult: ...


@dataclass(frozen=True)
class RequestRefused:
    """The engine would not take a request."""

    kind: ErrorKind
    message: str
    param: str | None = None


EngineEvent = StreamDelta | RequestRefused
T = TypeVar("T")


def refusal_or(call: Callable[[], T]) -> T | RequestRefused:
    """`call()`, or the `RequestRefused` that a refused call becomes (it pickles through Ray)."""
    try:
        return call()
    except InvalidRequestError as error:
        return RequestRefused("invalid_request", str(error), error.param)
    except CacheFullError as error:
        return RequestRefused("not_ready", str(error))


def unwrap(answer: T | RequestRefused) -> T:
    """The answer of `refusal_or`, with a refusal raised as ProtocolError."""
    if isinstance(answer, RequestRefused):
        raise ProtocolError(answer.kind, answer.message, answer.param)
    return answer


class EngineKV:
    """The engine's cached-KV calls as the client side wants them: blocking, refusals as values."""

    def __init__(self, engine: ServingEngine) -> None:
        self.engine = engine

    def config(self) -> dict[str, Any] | RequestRefused:
        return refusal_or(lambda: self.engine.kv_config().to_dict())

    def lookup(self, tokens: list[int], cache_salt: str) -> int | RequestRefused:
        return refusal_or(lambda: self.engine.kv_lookup(tokens, cache_salt))

    def retrieve(self, tokens: list[int], cache_salt: str) -> torch.Tensor | None | RequestRefused:
        return refusal_or(lambda: self.engine.kv_retrieve(tokens, cache_salt))

    def store(self, kv: torch.Tensor, tokens: list[int], cache_salt: str) -> StoreResult | RequestRefused:
        return refusal_or(lambda: self.engine.kv_store_chunks(kv, tokens, cache_salt))


async def engine_events(engine: ServingEngine | None, request: GenerateRequest) -> AsyncIterator[EngineEvent]:
    """One request's deltas (merged when the reader falls behind), or a single `RequestRefused`."""
    if engine is None:
        yield RequestRefused("not_ready", "Engine not initialized")
        return
    try:
        result = await engine.submit_async(request)
    except InvalidRequestError as error:
        yield RequestRefused("invalid_request", str(error), error.param)
        return
    except ValueError as error:
        yield RequestRefused("invalid_request", str(error))
        return
    async for delta in result.astream(coalesce=True):
        yield delta


async def deltas_from_events(events: AsyncIterator[Any]) -> AsyncIterator[StreamDelta]:
    """Deltas from an event stream; a `RequestRefused` raises ProtocolError."""
    try:
        async for event in events:
            if isinstance(event, RequestRefused):
                raise ProtocolError(event.kind, event.message, event.param)
            yield event
    finally:
        closer = getattr(events, "aclose", None)
        if closer is not None:
            await closer()


def model_info(engine: ServingEngine, served_name: str) -> ModelInfo:
    return ModelInfo(id=served_name, max_model_len=engine.max_model_len, created=engine.created)


class LocalEngineClient(EngineClient):
    """An `InferenceEngine` in this process."""

    def __init__(self, engine: InferenceEngine, served_name: str) -> None:
        self.engine = engine
        self.info = model_info(engine, served_name)
        self._kv = EngineKV(engine)

    def stream(self, request: GenerateRequest) -> AsyncIterator[StreamDelta]:
        return deltas_from_events(engine_events(self.engine, request))

    async def count_tokens(self, request: GenerateRequest) -> int:
        return count_tokens(self.engine, request)

    async def model_info(self) -> ModelInfo:
        return self.info

    async def stats(self) -> dict[str, int]:
        return self.engine.get_stats()

    async def ready(self) -> bool:
        return True

    # The KV calls wait for the scheduler thread: run them off the event loop.
    async def kv_config(self) -> dict[str, Any]:
        return unwrap(await asyncio.to_thread(self._kv.config))

    async def kv_lookup(self, tokens: list[int], cache_salt: str) -> int:
        return unwrap(await asyncio.to_thread(self._kv.lookup, tokens, cache_salt))

    async def kv_retrieve(self, tokens: list[int], cache_salt: str) -> torch.Tensor | None:
        return unwrap(await asyncio.to_thread(self._kv.retrieve, tokens, cache_salt))

    async def kv_store(self, kv: torch.Tensor, tokens: list[int], cache_salt: str) -> StoreResult:
        return unwrap(await asyncio.to_thread(self._kv.store, kv, tokens, cache_salt))


def count_tokens(engine: ServingEngine, request: GenerateRequest) -> int:
    return len(engine.prompt_ids(request))
