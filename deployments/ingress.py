"""Ingress: the HTTP API (serve_app.http.app) with an engine client made of Ray Serve handles."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.config import AppConfig
from serve_app.engine.calls import EngineCall
from serve_app.engine.request import GenerateRequest, StreamDelta
from serve_app.http.app import create_api
from serve_app.http.context import ServerContext
from serve_app.http.engine_client import (
    EngineClient,
    ModelInfo,
    deltas_from_events,
    unwrap,
)
from serve_app.http.protocols.errors import ProtocolError
from serve_app.http.tenants import TenantDirectory

logger = logging.getLogger(__name__)

# How long a readiness answer from the board is trusted.
READY_TTL_S = 0.5


class RayEngineClient(EngineClient):
    """Generation streams and calls from the engine deployment; readiness, model info and stats from the board."""

    def __init__(self, engine: DeploymentHandle, stats_board: DeploymentHandle) -> None:
        self._stream = engine.options(stream=True)
        # KV tensors (hundreds of MB) go through Ray's object store, not a replica's gRPC message limit.
        self._calls = engine.options(_by_reference=True)
        self._board = stats_board
        self._info: ModelInfo | None = None
        self._ready = False
        self._checked = 0.0
        self._refreshing: asyncio.Task | None = None

    async def stream(self, request: GenerateRequest) -> AsyncIterator[StreamDelta]:
        """The request's deltas; an engine replica lost on the way ends the stream with an error delta."""
        events = self._stream.generate.remote(request)
        started = False
        try:
            async for delta in deltas_from_events(events):
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
        return unwrap(await self._calls.ask.remote(call))

    async def model_info(self) -> ModelInfo:
        if self._info is None and not await self.ready():
            raise ProtocolError("not_ready", "Engine not initialized")
        assert self._info is not None
        return self._info

    async def stats(self) -> dict[str, int]:
        return await self._board.summed.remote()

    async def ready(self) -> bool:
        """The board's last answer; an old one is refreshed in the background, off the request's path."""
        if self._info is None:
            await self._refresh()
        elif time.monotonic() - self._checked > READY_TTL_S and self._refreshing is None:
            self._refreshing = asyncio.create_task(self._refresh_in_background())
        return self._ready and self._info is not None

    async def _refresh(self) -> None:
        self._ready, info = await self._board.status.remote()
        self._info = self._info or info
        self._checked = time.monotonic()

    async def _refresh_in_background(self) -> None:
        try:
            await self._refresh()
        except Exception:  # the board may be restarting; the next request tries again
            logger.warning("could not read readiness from the stats board", exc_info=True)
        finally:
            self._refreshing = None


@serve.deployment(name="Ingress", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    def __init__(self, engine: DeploymentHandle, stats_board: DeploymentHandle, config: dict[str, Any]) -> None:
        app_config = AppConfig.model_validate(config)
        server = app_config.server
        tenants = TenantDirectory.from_config(server.api_keys_file, server.cache_salt_secret)
        self.context = ServerContext(RayEngineClient(engine, stats_board), server, tenants=tenants)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_api(self.context)
