"""EngineDeployment: one engine per replica, in its own process, streaming deltas through an async generator."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import torch
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.config import AppConfig
from serve_app.engine_process import EngineProcess, EngineProcessError
from serve_app.kv.transfer import StoreResult
from serve_app.protocols.engine_client import (
    EngineEvent,
    EngineKV,
    RequestRefused,
    count_tokens,
    engine_events,
    model_info,
)
from serve_app.request import GenerateRequest

logger = logging.getLogger(__name__)

REPORT_EVERY_S = 0.2
HEARTBEAT_S = 1.0


@serve.deployment(name="EngineDeployment", max_ongoing_requests=256, logging_config={"enable_access_log": False})
class EngineDeployment:
    """Loads the model in its constructor, so a replica only takes traffic once it can serve it.

    The engine runs in a child process (`EngineProcess`), so its scheduler shares no interpreter
    lock with this replica's event loops and Ray's threads.
    """

    def __init__(self, config: dict[str, Any], stats_board: DeploymentHandle) -> None:
        app_config = AppConfig.model_validate(config)
        self.engine = EngineProcess(app_config.engine)
        self.info = model_info(self.engine, app_config.served_model_name)
        self.kv = EngineKV(self.engine)
        self._board = stats_board
        self._replica_id = serve.get_replica_context().replica_id.unique_id
        # On the replica's event loop: Serve handles may be called only from a running loop.
        self._reporter = asyncio.get_running_loop().create_task(self._report_stats())

    async def generate(self, request: GenerateRequest) -> AsyncIterator[EngineEvent]:
        async for event in engine_events(self.engine, request):
            yield event

    def count_tokens(self, request: GenerateRequest) -> int:
        return count_tokens(self.engine, request)

    # The KV calls wait for the engine process's answer: run them off the replica's event loop.
    async def kv_config(self) -> dict[str, Any] | RequestRefused:
        return await asyncio.to_thread(self.kv.config)

    async def kv_lookup(self, tokens: list[int], cache_salt: str) -> int | RequestRefused:
        return await asyncio.to_thread(self.kv.lookup, tokens, cache_salt)

    async def kv_retrieve(self, tokens: list[int], cache_salt: str) -> torch.Tensor | None | RequestRefused:
        return await asyncio.to_thread(self.kv.retrieve, tokens, cache_salt)

    async def kv_store(self, kv: torch.Tensor, tokens: list[int], cache_salt: str) -> StoreResult | RequestRefused:
        return await asyncio.to_thread(self.kv.store, kv, tokens, cache_salt)

    def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError("the engine process has exited")

    async def _report_stats(self) -> None:
        """Push stats to the board when they change, and at least every HEARTBEAT_S."""
        last: dict[str, int] | None = None
        waited = HEARTBEAT_S
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            waited += REPORT_EVERY_S
            try:
                stats = self.engine.latest_stats
            except EngineProcessError:
                return  # the health check fails this replica; the board forgets it when it falls silent
            if stats == last and waited < HEARTBEAT_S:
                continue
            try:
                await self._board.report.remote(self._replica_id, stats, self.info)
                last, waited = stats, 0.0
            except Exception:  # the board may be restarting; the next round retries
                logger.warning("could not report stats", exc_info=True)

    def __del__(self) -> None:
        reporter = getattr(self, "_reporter", None)
        if reporter is not None:
            reporter.cancel()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
