"""The Batch API as its routes see it (`Batches`: files and batches, per tenant), and `StoreError`, what it
refuses. `serve_app.batch.service.BatchService` serves it in process; on Ray, a deployment every ingress
replica shares (`deployments.batch.api`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class StoreError(Exception):
    """What the Batch API refuses: `kind` `invalid_request` (a 400), `not_found` (404) or `too_large` (413), the field."""

    def __init__(self, kind: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.kind, self.message, self.param = kind, message, param

    def __reduce__(self) -> tuple[type, tuple[str, str, str | None]]:
        return StoreError, (self.kind, self.message, self.param)


class Batches(ABC):
    """Files and batches, per tenant; what a call refuses raises `StoreError`."""

    @abstractmethod
    async def add_file(self, tenant: str, filename: str, purpose: str, data: bytes) -> dict[str, Any]: ...
    @abstractmethod
    async def file(self, tenant: str, file_id: str) -> dict[str, Any]: ...
    @abstractmethod
    async def content(self, tenant: str, file_id: str) -> bytes: ...
    @abstractmethod
    async def files(self, tenant: str, purpose: str | None, after: str | None, limit: int, order: str) -> dict[str, Any]: ...
    @abstractmethod
    async def delete_file(self, tenant: str, file_id: str) -> dict[str, Any]: ...
    @abstractmethod
    async def create_batch(self, tenant: str, body: Any) -> dict[str, Any]: ...
    @abstractmethod
    async def batch(self, tenant: str, batch_id: str) -> dict[str, Any]: ...
    @abstractmethod
    async def batches(self, tenant: str, after: str | None, limit: int) -> dict[str, Any]: ...
    @abstractmethod
    async def cancel_batch(self, tenant: str, batch_id: str) -> dict[str, Any]: ...
