"""The engine's serving boundary: what Serve's deployment and the HTTP layer need of an engine.

`ServingEngine` is met by `InferenceEngine` (in process) and `EngineProcess` (in its own). A
refused request or call becomes a `RequestRefused` value, which pickles through Ray streams and
handles; the HTTP side turns it back into an error of its protocol's shape.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from serve_app.config import ToolFormat
from serve_app.engine.io import EncodedRequest, EngineCall, RequestRefused, StreamDelta
from serve_app.engine.result import GenerateResult
from serve_app.errors import CacheFullError, EngineOverloadedError, InvalidRequestError

class ServingEngine(Protocol):
    """An engine, in this process or in its own."""

    max_model_len: int
    created: int
    tool_format: ToolFormat

    async def submit_async(self, request: EncodedRequest) -> GenerateResult: ...
    async def answer_async(self, call: EngineCall) -> Any: ...

    @property
    def healthy(self) -> bool: ...


EngineEvent = StreamDelta | RequestRefused


def refusal(error: Exception) -> RequestRefused | None:
    """The refusal an engine error stands for; None for an error that is the server's fault."""
    if isinstance(error, InvalidRequestError):
        return RequestRefused("invalid_request", str(error), error.param)
    if isinstance(error, (EngineOverloadedError, CacheFullError)):
        return RequestRefused("overloaded", str(error))
    if isinstance(error, ValueError):
        return RequestRefused("invalid_request", str(error))
    return None


async def engine_events(engine: ServingEngine | None, request: EncodedRequest) -> AsyncIterator[EngineEvent]:
    """One request's deltas (merged when the reader falls behind), or a single `RequestRefused`."""
    if engine is None:
        yield RequestRefused("not_ready", "Engine not initialized")
        return
    try:
        result = await engine.submit_async(request)
    except Exception as error:
        refused = refusal(error)
        if refused is None:
            raise
        yield refused
        return
    async for delta in result.astream(coalesce=True):
        yield delta


async def answer_or_refusal(engine: ServingEngine, call: EngineCall) -> Any:
    """The engine's answer to `call`, or the `RequestRefused` it amounts to."""
    try:
        return await engine.answer_async(call)
    except Exception as error:
        refused = refusal(error)
        if refused is None:
            raise
        return refused
