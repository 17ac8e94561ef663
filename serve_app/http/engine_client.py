"""How the HTTP layer reaches an engine: the `EngineClient` interface, and `LocalEngineClient` in process.

Serve's ingress has its own client made of Ray handles (`deployments.ingress.RayEngineClient`).
Either way an engine's refusal arrives as a `RequestRefused` value and leaves here as a
`ProtocolError`, before any delta.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, TypeVar

from serve_app.engine.io import EncodedRequest, EngineCall, ModelInfo, RequestRefused, StreamDelta
from serve_app.engine.serving import answer_or_refusal, engine_events
from serve_app.http.prompt_encoder import PromptEncoder
from serve_app.http.protocols.errors import ProtocolError

if TYPE_CHECKING:
    from serve_app.engine.engine import InferenceEngine

T = TypeVar("T")


class EngineClient(ABC):
    """An engine as the routes see it: the encoder of its prompts, streams of deltas, calls, and what the server
    reports."""

    prompts: PromptEncoder

    @abstractmethod
    def stream(self, request: EncodedRequest) -> AsyncIterator[StreamDelta]:
        """Deltas of one request; raises ProtocolError (before any delta) for a request the engine refuses."""

    @abstractmethod
    async def ask(self, call: EngineCall) -> Any:
        """The engine's answer to `call` (the calls in `serve_app.engine.io`); ProtocolError for what it refuses."""

    @abstractmethod
    async def model_info(self) -> ModelInfo: ...

    @abstractmethod
    async def stats(self) -> dict[str, int]:
        """The stats of every engine replica, summed."""

    @abstractmethod
    async def replica_stats(self) -> dict[str, dict[str, Any]]:
        """Each engine replica's stats, its `model` (and, on a Ray cluster, its `node_id` and `pid`), by replica
        id; on a Ray cluster, the replicas of every model."""

    @abstractmethod
    async def routing_stats(self) -> dict[str, dict[str, Any]]:
        """Each request router's decision count and cost and its recent decisions, by router; none where nothing
        routes."""

    @abstractmethod
    async def ready(self) -> bool: ...


# Engine fields that clients name otherwise: an adapter is named in the request's `model`.
_CLIENT_NAMES = {"lora": "model"}


def unwrap(answer: T | RequestRefused) -> T:
    """An engine's answer, with a refusal raised as ProtocolError (naming the field as clients know it)."""
    if isinstance(answer, RequestRefused):
        param = _CLIENT_NAMES.get(answer.param or "", answer.param)
        message = answer.message
        if param != answer.param and answer.param and message.startswith(f"{answer.param}: "):
            message = f"{param}: {message.removeprefix(f'{answer.param}: ')}"
        raise ProtocolError(answer.kind, message, param)
    return answer


async def deltas_from_events(events: AsyncIterator[Any]) -> AsyncIterator[StreamDelta]:
    """Deltas from an engine's event stream; a `RequestRefused` raises ProtocolError."""
    try:
        async for event in events:
            yield unwrap(event)
    finally:
        closer = getattr(events, "aclose", None)
        if closer is not None:
            await closer()


class LocalEngineClient(EngineClient):
    """An `InferenceEngine` in this process."""

    def __init__(self, engine: InferenceEngine, served_name: str) -> None:
        self.engine = engine
        self.prompts = PromptEncoder(engine.tokenizer)
        self.info = ModelInfo(served_name, engine.max_model_len, engine.created, engine.tool_format)

    def stream(self, request: EncodedRequest) -> AsyncIterator[StreamDelta]:
        return deltas_from_events(engine_events(self.engine, request))

    async def ask(self, call: EngineCall) -> Any:
        return unwrap(await answer_or_refusal(self.engine, call))

    async def model_info(self) -> ModelInfo:
        return self.info

    async def stats(self) -> dict[str, int]:
        return self.engine.get_stats()

    async def replica_stats(self) -> dict[str, dict[str, Any]]:
        return {"in-process": {"model": self.info.id, **self.engine.get_stats()}}

    async def routing_stats(self) -> dict[str, dict[str, Any]]:
        return {}  # one engine in process: nothing to route between

    async def ready(self) -> bool:
        return self.engine.healthy
