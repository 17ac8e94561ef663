"""BatchService: the Batch API (`Batches`) served from a store, its batches run on the event loop it is first
called on: in process, or inside the Batch API's deployment on Ray."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from serve_app.batch.answering import BatchAnswerer
from serve_app.batch.runner import BatchRunner
from serve_app.batch.store import BatchStore
from serve_app.config import default_cache_dir
from serve_app.http.batches import Batches
from serve_app.http.context import ServerContext
from serve_app.http.tenants import Tenant


class BatchService(Batches):
    def __init__(self, store: BatchStore, answerer_for: Callable[[str], BatchAnswerer], concurrency: int) -> None:
        self.store = store
        self.runner = BatchRunner(store, answerer_for, concurrency)
        self._running: asyncio.Task | None = None

    @classmethod
    def serving(cls, context: ServerContext) -> BatchService:
        """The Batch API of the server `context` describes: its store where the config puts it, within its bounds,
        and each tenant's lines answered by its models, within its limits, under the tenant's cache salt, behind
        online requests."""
        config = context.config
        store = BatchStore(
            config.batch_files_path or default_cache_dir() / "batches", config.max_batch_file_bytes,
            config.max_batch_bytes_per_tenant, config.max_batch_lines,
        )

        def answerer_for(tenant_id: str) -> BatchAnswerer:
            tenant = Tenant(tenant_id, "user")
            salt = lambda client_salt: context.tenant_salt(tenant, client_salt)  # noqa: E731
            return BatchAnswerer(context.models, context.limits, salt, context.metrics, background=True)

        return cls(store, answerer_for, config.batch_concurrency)

    def start(self) -> None:
        """Run batches (those a restart left unfinished first) on this event loop, if not yet."""
        if self._running is None or self._running.done():
            self._running = asyncio.get_running_loop().create_task(self.runner.run())

    def stop(self) -> None:
        if self._running is not None:
            self._running.cancel()

    async def add_file(self, tenant: str, filename: str, purpose: str, data: bytes) -> dict[str, Any]:
        return await asyncio.to_thread(self.store.add_file, tenant, filename, purpose, data)

    async def file(self, tenant: str, file_id: str) -> dict[str, Any]:
        return self.store.file(tenant, file_id)

    async def content(self, tenant: str, file_id: str) -> bytes:
        return await asyncio.to_thread(self.store.content, tenant, file_id)

    async def files(self, tenant: str, purpose: str | None, after: str | None, limit: int, order: str) -> dict[str, Any]:
        return self.store.files(tenant, purpose, after, limit, order).body()

    async def delete_file(self, tenant: str, file_id: str) -> dict[str, Any]:
        return self.store.delete_file(tenant, file_id)

    async def create_batch(self, tenant: str, body: Any) -> dict[str, Any]:
        batch = self.store.create_batch(tenant, body)
        self.start()
        self.runner.wake()
        return batch

    async def batch(self, tenant: str, batch_id: str) -> dict[str, Any]:
        return self.store.batch(tenant, batch_id)

    async def batches(self, tenant: str, after: str | None, limit: int) -> dict[str, Any]:
        return self.store.batches(tenant, after, limit).body()

    async def cancel_batch(self, tenant: str, batch_id: str) -> dict[str, Any]:
        return self.runner.cancel(tenant, batch_id)
