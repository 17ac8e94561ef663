"""The engine's serving boundary: what Serve's deployment and the HTTP layer need of an engine.

`ServingEngine` is met by `InferenceEngine` (in process) and `EngineProcess` (in its own). What
either refuses arrives as a `RequestRefused` (`refused` also names a bare ValueError so), which
pickles through Ray streams and handles; the HTTP side turns it into its protocol's error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from serve_app.wire.calls import EngineCall
from serve_app.wire.model_card import ToolFormat
from serve_app.wire.outputs import StreamDelta
from serve_app.wire.refusals import RequestRefused
from serve_app.wire.requests import EncodedRequest


class DeltaStream(Protocol):
    """One request's deltas as they come (merged when the reader falls behind); closing it early cancels it."""

    def __aiter__(self) -> AsyncIterator[StreamDelta]: ...
    async def aclose(self) -> None: ...


class ServingEngine(Protocol):
    """An engine, in this process or in its own."""

    max_model_len: int
    created: int
    tool_format: ToolFormat
    vocab_size: int
    hidden_size: int

    async def stream(self, request: EncodedRequest) -> DeltaStream: ...
    async def answer_async(self, call: EngineCall) -> Any: ...

    @property
    def healthy(self) -> bool: ...


def refused(error: Exception) -> RequestRefused | None:
    """The refusal an engine error stands for; None for an error that is the server's fault."""
    if isinstance(error, RequestRefused):
        return error
    if isinstance(error, ValueError):  # a library's check of the request (a grammar that does not compile)
        return RequestRefused(str(error))
    return None


async def open_stream(engine: ServingEngine, request: EncodedRequest) -> DeltaStream:
    """The request's stream; raises the `RequestRefused` a refusal amounts to."""
    try:
        return await engine.stream(request)
    except Exception as error:
        refusal = refused(error)
        if refusal is None or refusal is error:
            raise
        raise refusal from error


async def answer_or_refusal(engine: ServingEngine, call: EngineCall) -> Any:
    """The engine's answer to `call`, or the `RequestRefused` it amounts to."""
    try:
        return await engine.answer_async(call)
    except Exception as error:
        refusal = refused(error)
        if refusal is None:
            raise
        return refusal
