"""Each model's engine client made of Ray Serve handles (`RayEngineClient`): generation streams from its engine
deployment through the request router, calls, and readiness and stats from the replica board; with the model's
`PromptEncoder`, so prompts are rendered and tokenized where the client runs (the ingress, the Batch API), once,
and the engine replicas get token ids the router can hash."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ray.serve import context as serve_context
from ray.serve.handle import DeploymentHandle

from deployments.app_args import AppConfig
from deployments.model_copy import model_here
from serve_app.http.engine_client import EngineClient, unwrap
from serve_app.http.prompt_encoder import PromptEncoder
from serve_app.http.protocols.errors import ProtocolError
from serve_app.http.served_models import ServedModels
from serve_app.model.loader import resolve_model_path
from serve_app.model.tokenizer import Tokenizer
from serve_app.wire.calls import EngineCall
from serve_app.wire.model_card import ModelInfo
from serve_app.wire.outputs import StreamDelta
from serve_app.wire.requests import EncodedRequest

logger = logging.getLogger(__name__)

# How long a readiness answer from the board is trusted.
READY_TTL_S = 0.5


class RayEngineClient(EngineClient):
    """Generation streams and calls from one model's engine deployment; its readiness and model info, and the
    stats of every engine, from the board."""

    def __init__(self, engine: DeploymentHandle, board: DeploymentHandle, prompts: PromptEncoder) -> None:
        self.prompts = prompts
        self._deployment = engine.deployment_name
        self._stream = engine.options(stream=True)
        # KV tensors (hundreds of MB) go through Ray's object store, not a replica's gRPC message limit.
        self._calls = engine.options(_by_reference=True)
        self._board = board
        self._info: ModelInfo | None = None
        self._ready = False
        self._checked = 0.0
        self._refreshing: asyncio.Task | None = None

    async def stream(self, request: EncodedRequest) -> AsyncIterator[StreamDelta]:
        """The request's deltas; an engine replica lost on the way ends the stream with an error delta."""
        events = _as_its_own_call().run(self._stream.generate.remote, request)
        started = False
        try:
            async for event in events:
                delta = unwrap(event)  # a refusal, before any delta, raises the protocol's error
                started = True
                yield delta
        except ProtocolError:
            raise
        except Exception as error:  # the replica died or Ray failed: not the client's doing
            logger.warning("engine stream failed: %s", error)
            if not started:
                raise ProtocolError("not_ready", "the engine replica is unavailable; retry shortly") from None
            yield StreamDelta("", (), "error", error="the engine replica serving this request failed")
        finally:
            events.cancel()

    async def ask(self, call: EngineCall) -> Any:
        return unwrap(await _as_its_own_call().run(self._calls.ask.remote, call))

    async def model_info(self) -> ModelInfo:
        if self._info is None and not await self.ready():
            raise ProtocolError("not_ready", "Engine not initialized")
        assert self._info is not None
        return self._info

    async def stats(self) -> dict[str, int]:
        return await self._board.summed.remote()

    async def replica_stats(self) -> dict[str, dict[str, Any]]:
        return await self._board.per_replica.remote()

    async def routing_stats(self) -> dict[str, dict[str, Any]]:
        return await self._board.routing.remote()

    async def ready(self) -> bool:
        """The board's last answer; an old one is refreshed in the background, off the request's path."""
        if self._info is None:
            await self._refresh()
        elif time.monotonic() - self._checked > READY_TTL_S and self._refreshing is None:
            self._refreshing = asyncio.create_task(self._refresh_in_background())
        return self._ready and self._info is not None

    async def _refresh(self) -> None:
        self._ready, info = await self._board.status.remote(self._deployment)
        self._info = self._info or info
        self._checked = time.monotonic()

    async def _refresh_in_background(self) -> None:
        try:
            await self._refresh()
        except Exception:  # the board may be restarting; the next request tries again
            logger.warning("could not read readiness from the replica board", exc_info=True)
        finally:
            self._refreshing = None


def served_models(config: AppConfig, engines: dict[str, DeploymentHandle], board: DeploymentHandle) -> ServedModels:
    """Each model's engine client: its engine deployment's handle and its tokenizer, prepared on this node."""
    clients = {}
    for model_id, engine in engines.items():
        model = config.model(model_id).engine().model
        folder = resolve_model_path(model_here(model.name, model.cache_dir), model.cache_dir)
        prompts = PromptEncoder(Tokenizer(folder, cache_dir=model.cache_dir))
        clients[model_id] = RayEngineClient(engine, board, prompts)
    return ServedModels(clients)


def _as_its_own_call() -> contextvars.Context:
    """A context in which a handle call gets an internal request id of its own. Serve takes the id
    from the HTTP request's context, so the engine calls of one request (its `n` choices) would
    share it, and a request router without FIFO order (ours) matches a routed call to its pending
    request by that id: the second call would never be routed."""
    context = contextvars.copy_context()
    current = serve_context._get_serve_request_context()
    fresh = dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex)
    context.run(serve_context._serve_request_context.set, fresh)
    return context
