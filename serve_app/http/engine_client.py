"""How the HTTP layer reaches an engine: the `EngineClient` interface, and `LocalEngineClient` with no Ray handle
between (an engine in process, or the engine process of the client's own actor).

Serve's ingress has its own client made of Ray handles (`deployments.engine_clients.RayEngineClient`).
Either way an engine's refusal arrives as a `RequestRefused` and leaves the client as a
`ProtocolError` (`ProtocolError.of`), before any delta.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from serve_app.engine.core_client import CoreClient, answer_or_refusal, open_stream
from serve_app.http.prompt_encoder import PromptEncoder
from serve_app.http.protocols.errors import ProtocolError
from serve_app.wire.calls import EngineCall
from serve_app.wire.model_card import GrammarConfig, ModelInfo
from serve_app.wire.outputs import StreamDelta
from serve_app.wire.refusals import RequestRefused
from serve_app.wire.requests import EncodedRequest

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
        """The engine's answer to `call` (the calls in `serve_app.wire.calls`); ProtocolError for what it refuses."""

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


def unwrap(answer: T | RequestRefused) -> T:
    """An engine's answer, with a refusal raised as the protocol's error."""
    if isinstance(answer, RequestRefused):
        raise ProtocolError.of(answer)
    return answer


def model_card(engine: CoreClient, served_name: str, grammar: GrammarConfig) -> ModelInfo:
    """The card of the model `engine` serves as `served_name`, with its engine's grammar bounds."""
    return ModelInfo(
        served_name, engine.max_model_len, engine.created, engine.tool_format, engine.vocab_size, engine.hidden_size,
        grammar, engine.reasoning_parser,
    )


class LocalEngineClient(EngineClient):
    """An engine core reached directly: an `InferenceEngine` in this process, or an `EngineProcess` of this
    process's own."""

    def __init__(self, engine: CoreClient, info: ModelInfo) -> None:
        self.engine = engine
        self.prompts = PromptEncoder(engine.tokenizer)
        self.info = info

    async def stream(self, request: EncodedRequest) -> AsyncIterator[StreamDelta]:
        try:
            deltas = await open_stream(self.engine, request)
        except RequestRefused as refused:
            raise ProtocolError.of(refused) from None
        try:
            async for delta in deltas:
                yield delta
        finally:
            await deltas.aclose()

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
