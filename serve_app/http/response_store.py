"""ResponseStore: the finished Responses-API responses kept for `previous_response_id` and
`GET`/`DELETE /v1/responses/{id}`, per tenant (a tenant never sees another's), bounded by count and
age. `Responses` is how the HTTP layer reaches it: in this process, or (on a Ray cluster) a
deployment every ingress replica shares."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from serve_app.http.tools.plan import Turn


@dataclass(frozen=True)
class StoredResponse:
    """A response object as it was answered, and the conversation up to its end (without its instructions)."""

    response: dict[str, Any]
    turns: tuple[Turn, ...]


class ResponseStore:
    def __init__(self, max_per_tenant: int, max_age_s: float) -> None:
        self.max_per_tenant = max_per_tenant
        self.max_age_s = max_age_s
        self._tenants: dict[str, OrderedDict[str, tuple[float, StoredResponse]]] = {}

    def put(self, tenant: str, stored: StoredResponse) -> None:
        kept = self._tenants.setdefault(tenant, OrderedDict())
        kept[stored.response["id"]] = (time.monotonic(), stored)
        while len(kept) > self.max_per_tenant:
            kept.popitem(last=False)

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        kept = self._expire(tenant)
        entry = kept.get(response_id)
        return entry[1] if entry is not None else None

    def delete(self, tenant: str, response_id: str) -> bool:
        return self._expire(tenant).pop(response_id, None) is not None

    def _expire(self, tenant: str) -> OrderedDict[str, tuple[float, StoredResponse]]:
        kept = self._tenants.get(tenant, OrderedDict())
        deadline = time.monotonic() - self.max_age_s
        while kept and next(iter(kept.values()))[0] < deadline:
            kept.popitem(last=False)
        if not kept:
            self._tenants.pop(tenant, None)
        return kept


class Responses(ABC):
    """The store as the routes see it."""

    @abstractmethod
    async def put(self, tenant: str, stored: StoredResponse) -> None: ...

    @abstractmethod
    async def get(self, tenant: str, response_id: str) -> StoredResponse | None: ...

    @abstractmethod
    async def delete(self, tenant: str, response_id: str) -> bool: ...


class LocalResponses(Responses):
    """A store in this process."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def put(self, tenant: str, stored: StoredResponse) -> None:
        self.store.put(tenant, stored)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        return self.store.get(tenant, response_id)

    async def delete(self, tenant: str, response_id: str) -> bool:
        return self.store.delete(tenant, response_id)
