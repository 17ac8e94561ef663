"""BatchAPIDeployment: OpenAI's Batch API's files and batches in one replica that every ingress replica shares,
which also runs the batches: through the engine deployments' handles and request router, as the ingress sends
online requests, at most `batch_concurrency` at once. `RayBatches` is how an ingress reaches it."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.access import ServerAccess
from deployments.app_args import AppConfig
from deployments.engine_clients import served_models
from deployments.ray_metrics import RayMetrics
from serve_app.batch.service import BatchService
from serve_app.http.batches import Batches, StoreError
from serve_app.http.context import ServerContext
from serve_app.metrics.catalog import REQUEST_METRICS
from serve_app.metrics.prometheus import ServerMetrics

# The calls an ingress makes (`Batches`' methods).
CALLS = frozenset(name for name in Batches.__abstractmethods__)


@serve.deployment(
    name="BatchAPI", num_replicas=1, ray_actor_options={"num_cpus": 0}, logging_config={"enable_access_log": False},
)
class BatchAPIDeployment:
    def __init__(self, engines: dict[str, DeploymentHandle], board: DeploymentHandle, config: dict[str, Any],
                 access: dict[str, Any]) -> None:
        app_config = AppConfig.model_validate(config)
        server = app_config.server
        replica = serve.get_replica_context().replica_id.unique_id
        metrics = ServerMetrics(replica, RayMetrics(REQUEST_METRICS), server.metrics_names)
        context = ServerContext(
            served_models(app_config, engines, board), server, metrics, tenants=ServerAccess(**access).tenants()
        )
        self.service = BatchService.serving(context)
        self.service.start()  # batches a restart left unfinished go on

    async def call(self, name: str, *args: Any) -> Any:
        """`Batches.<name>(*args)`'s answer, or the StoreError it raised (a value: it crosses Ray as it is)."""
        if name not in CALLS:
            raise ValueError(f"not a Batch API call: {name}")
        try:
            return await getattr(self.service, name)(*args)
        except StoreError as error:
            return error

    def __del__(self) -> None:
        service = getattr(self, "service", None)
        if service is not None:
            service.stop()


class RayBatches(Batches):
    def __init__(self, deployment: DeploymentHandle) -> None:
        self._deployment = deployment

    async def _call(self, name: str, *args: Any) -> Any:
        answer = await self._deployment.call.remote(name, *args)
        if isinstance(answer, StoreError):
            raise answer
        return answer

    async def add_file(self, tenant: str, filename: str, purpose: str, data: bytes) -> dict[str, Any]:
        return await self._call("add_file", tenant, filename, purpose, data)

    async def file(self, tenant: str, file_id: str) -> dict[str, Any]:
        return await self._call("file", tenant, file_id)

    async def content(self, tenant: str, file_id: str) -> bytes:
        return await self._call("content", tenant, file_id)

    async def files(self, tenant: str, purpose: str | None, after: str | None, limit: int, order: str) -> dict[str, Any]:
        return await self._call("files", tenant, purpose, after, limit, order)

    async def delete_file(self, tenant: str, file_id: str) -> dict[str, Any]:
        return await self._call("delete_file", tenant, file_id)

    async def create_batch(self, tenant: str, body: Any) -> dict[str, Any]:
        return await self._call("create_batch", tenant, body)

    async def batch(self, tenant: str, batch_id: str) -> dict[str, Any]:
        return await self._call("batch", tenant, batch_id)

    async def batches(self, tenant: str, after: str | None, limit: int) -> dict[str, Any]:
        return await self._call("batches", tenant, after, limit)

    async def cancel_batch(self, tenant: str, batch_id: str) -> dict[str, Any]:
        return await self._call("cancel_batch", tenant, batch_id)
