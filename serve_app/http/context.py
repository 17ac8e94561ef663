"""ServerContext: what every route needs (the served models' engine clients, config, limits, tenants,
metrics, stored responses, the Batch API), and who is calling."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from serve_app.config import ServerConfig
from serve_app.http.batches import Batches
from serve_app.http.body import read_json
from serve_app.http.engine_client import EngineClient
from serve_app.http.protocols.errors import ProtocolError, invalid
from serve_app.http.protocols.limits import RequestLimits
from serve_app.http.response_store import LocalResponses, Responses, ResponseStore
from serve_app.http.served_models import ServedModels
from serve_app.http.tenants import (
    Tenant,
    TenantDirectory,
    TenantSlots,
    check_client_salt,
)
from serve_app.metrics.prometheus import ServerMetrics
from serve_app.wire.model_card import ModelInfo


@dataclass
class ServerContext:
    models: ServedModels
    config: ServerConfig = field(default_factory=ServerConfig)
    metrics: ServerMetrics | None = None  # None: one in this process, named as the config says
    tenants: TenantDirectory = field(default_factory=TenantDirectory.open)
    responses: Responses | None = None  # the Responses API's store; None: one in this process
    batches: Batches | None = None  # the Batch API's files and batches (`BatchService.serving`); None: not served
    slots: TenantSlots = field(init=False)
    limits: RequestLimits = field(init=False)

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = ServerMetrics(naming=self.config.metrics_names)
        if self.responses is None:
            self.responses = LocalResponses(
                ResponseStore(self.config.max_stored_responses, self.config.stored_response_max_age_s)
            )
        self.slots = TenantSlots(self.config.max_concurrent_per_tenant)
        self.limits = RequestLimits.from_config(self.config)

    def caller(self, request: Request, admin: bool = False) -> Tenant:
        """Who sent `request` (`Authorization: Bearer <key>` or `x-api-key`): 401 when unknown, 403 when not admin."""
        key = request.headers.get("x-api-key") or None  # an empty one hides no Bearer key
        authorization = request.headers.get("authorization", "")
        if key is None and authorization.lower().startswith("bearer "):
            key = authorization[7:].strip()
        tenant = self.tenants.authenticate(key)
        if tenant is None:
            raise ProtocolError("authentication", "a valid API key is required (Authorization: Bearer or x-api-key)")
        if admin and not tenant.is_admin:
            if not self.tenants.auth_enabled:
                raise ProtocolError(
                    "permission",
                    "without API keys this route is served only where the server listens on a loopback address: "
                    "configure API keys (SERVE_APP_API_KEYS), or set open_mode_admin: anywhere",
                )
            raise ProtocolError("permission", "this route needs an admin API key")
        return tenant

    def take_slot(self, tenant: Tenant) -> None:
        """One of `tenant`'s slots for a request's work (429 when all are taken); give it back with `slots.give_back`."""
        if not self.slots.try_take(tenant):
            limit = self.config.max_concurrent_per_tenant
            raise ProtocolError("rate_limit", f"over max_concurrent_per_tenant={limit} requests in flight")

    @contextmanager
    def slot(self, tenant: Tenant) -> Iterator[None]:
        """Hold one of `tenant`'s slots for the work inside (429 when all are taken)."""
        self.take_slot(tenant)
        try:
            yield
        finally:
            self.slots.give_back(tenant)

    async def model_call(self, request: Request) -> tuple[Tenant, Any, EngineClient, ModelInfo]:
        """A call to one model besides generating (counting or converting tokens): its caller, once every engine
        is ready, its JSON body, and the engine client and card of the model the body's `model` names."""
        tenant = await self.ready_caller(request)
        body = await read_json(request, self.config.max_request_bytes)
        engine = self.models.client_of(body)
        return tenant, body, engine, await engine.model_info()

    async def ready_caller(self, request: Request, admin: bool = False) -> Tenant:
        """The authenticated caller, once every model's engine is ready (503 before)."""
        tenant = self.caller(request, admin)
        if not await self.models.ready():
            raise ProtocolError("not_ready", "Engine not initialized")
        return tenant

    def tenant_salt(self, tenant: Tenant, client_salt: str | None) -> str:
        """The tenant's cache salt for a caller's request (None: the client gave none): the only way a salt
        reaches the engine, and the one place a client's salt is checked."""
        if client_salt is not None:
            try:
                check_client_salt(client_salt)
            except ValueError as error:
                raise invalid(f"cache_salt: {error}", "cache_salt") from None
        return self.tenants.tenant_salt(tenant, client_salt or "")


def context_of(request: Request) -> ServerContext:
    return request.app.state.context
