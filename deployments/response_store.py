"""ResponseStoreDeployment: the Responses API's stored responses in one replica that every ingress
replica shares, so a `previous_response_id` is found whichever ingress answers; `RayResponses` is
how an ingress reaches it."""

from __future__ import annotations

from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.http.response_store import Responses, ResponseStore, StoredResponse


@serve.deployment(
    name="ResponseStore",
    num_replicas=1,
    ray_actor_options={"num_cpus": 0},
    logging_config={"enable_access_log": False},
)
class ResponseStoreDeployment:
    def __init__(self, max_per_tenant: int, max_age_s: float) -> None:
        self._store = ResponseStore(max_per_tenant, max_age_s)

    def put(self, tenant: str, stored: StoredResponse) -> None:
        self._store.put(tenant, stored)

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        return self._store.get(tenant, response_id)

    def delete(self, tenant: str, response_id: str) -> bool:
        return self._store.delete(tenant, response_id)


class RayResponses(Responses):
    def __init__(self, store: DeploymentHandle) -> None:
        self._store = store

    async def put(self, tenant: str, stored: StoredResponse) -> None:
        await self._store.put.remote(tenant, stored)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        return await self._store.get.remote(tenant, response_id)

    async def delete(self, tenant: str, response_id: str) -> bool:
        return await self._store.delete.remote(tenant, response_id)
