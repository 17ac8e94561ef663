"""CoreClient: the one family of clients of an engine core -- `InferenceEngine` in this process, `EngineProcess`
across one (as vLLM's in-process and multiprocess core clients).

Either takes an `EncodedRequest` and gives its `DeltaStream`, answers `EngineCall`s, aborts, and says whether it
can still serve. What either refuses arrives as a `RequestRefused` (`refused` also names a bare ValueError so),
which pickles through Ray streams and handles; the HTTP side turns it into its protocol's error.
"""

from __future__ import annotations

from typing import Any, Protocol

from serve_app.engine.delta_stream import DeltaListener, DeltaStream
from serve_app.model.tokenizer import Tokenizer
from serve_app.wire.calls import EngineCall
from serve_app.wire.model_card import ReasoningParser, ToolFormat
from serve_app.wire.refusals import RequestRefused
from serve_app.wire.requests import EncodedRequest


class CoreClient(Protocol):
    """An engine core, in this process or in its own."""

    max_model_len: int
    created: int
    tool_format: ToolFormat
    reasoning_parser: ReasoningParser | None
    vocab_size: int
    hidden_size: int
    tokenizer: Tokenizer  # the text of its token ids is made where the client runs

    def add_request(self, request: EncodedRequest, listener: DeltaListener | None = None) -> DeltaStream: ...
    async def add_request_async(self, request: EncodedRequest) -> DeltaStream: ...
    def abort(self, task_id: int) -> None: ...
    def answer(self, call: EngineCall) -> Any: ...
    async def answer_async(self, call: EngineCall) -> Any: ...
    def get_stats(self) -> dict[str, int]: ...
    def shutdown(self) -> None: ...

    @property
    def healthy(self) -> bool: ...


def refused(error: Exception) -> RequestRefused | None:
    """The refusal an engine error stands for; None for an error that is the server's fault."""
    if isinstance(error, RequestRefused):
        return error
    if isinstance(error, ValueError):  # a library's check of the request (a grammar that does not compile)
        return RequestRefused(str(error))
    return None


async def open_stream(core: CoreClient, request: EncodedRequest) -> DeltaStream:
    """The request's stream; raises the `RequestRefused` a refusal amounts to."""
    try:
        return await core.add_request_async(request)
    except Exception as error:
        refusal = refused(error)
        if refusal is None or refusal is error:
            raise
        raise refusal from error


async def answer_or_refusal(core: CoreClient, call: EngineCall) -> Any:
    """The core's answer to `call`, or the `RequestRefused` it amounts to."""
    try:
        return await core.answer_async(call)
    except Exception as error:
        refusal = refused(error)
        if refusal is None:
            raise
        return refusal
