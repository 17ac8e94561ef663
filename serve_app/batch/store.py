"""BatchStore: OpenAI's Batch API's files and batches, per tenant (a tenant never sees another's), on a folder
of their own (files 0600), within a byte budget per tenant. A file is its bytes and its File object; a batch
is its Batch object, whose output and error files grow as its lines are answered. What the store holds
survives a restart of its process: it is read back from the folder."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve_app.batch.file_format import BATCH_URLS
from serve_app.http.batches import StoreError

# The purposes a file may be uploaded with (OpenAI's others are for routes this server does not have), and the
# purpose of the files a batch writes.
UPLOAD_PURPOSES = ("batch",)
OUTPUT_PURPOSE = "batch_output"
COMPLETION_WINDOWS = {"24h": 24 * 3600}
# A batch in one of these statuses has ended: its record changes no more.
ENDED = ("failed", "completed", "expired", "cancelled")
TENANT_FILE = "tenant"


@dataclass(frozen=True)
class Page:
    """A page of a list: its objects and whether more follow."""

    data: list[dict[str, Any]]
    has_more: bool

    def body(self) -> dict[str, Any]:
        return {
            "object": "list", "data": self.data, "has_more": self.has_more,
            "first_id": self.data[0]["id"] if self.data else None, "last_id": self.data[-1]["id"] if self.data else None,
        }


def _write(path: Path, data: bytes) -> None:
    """`data` into `path` whole (staged, then renamed), readable by its owner only."""
    staged = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    descriptor = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as out:
        out.write(data)
    os.replace(staged, path)


class BatchStore:
    def __init__(self, root: Path, max_file_bytes: int, max_tenant_bytes: int, max_lines: int) -> None:
        self.root = Path(root)
        self.max_file_bytes = max_file_bytes
        self.max_tenant_bytes = max_tenant_bytes
        self.max_lines = max_lines

    # -- files --------------------------------------------------------------------------------
    def add_file(self, tenant: str, filename: str, purpose: str, data: bytes) -> dict[str, Any]:
        if purpose not in UPLOAD_PURPOSES:
            raise StoreError("invalid_request", f"purpose: {purpose!r}; this server takes files for {', '.join(UPLOAD_PURPOSES)}", "purpose")
        if len(data) > self.max_file_bytes:
            raise StoreError("too_large", f"file: {len(data)} bytes, over max_batch_file_bytes={self.max_file_bytes}", "file")
        return self._new_file(tenant, filename, purpose, data)

    def _new_file(self, tenant: str, filename: str, purpose: str, data: bytes = b"") -> dict[str, Any]:
        held = self.tenant_bytes(tenant)
        if held + len(data) > self.max_tenant_bytes:
            raise StoreError(
                "too_large", f"file: the tenant's files would hold {held + len(data)} bytes, over "
                f"max_batch_bytes_per_tenant={self.max_tenant_bytes}; delete some first", "file",
            )
        record = {"id": f"file-{secrets.token_hex(12)}", "object": "file", "created_at": int(time.time()),
                  "filename": filename, "purpose": purpose, "status": "processed", "expires_at": None}
        folder = self._folder(tenant, "files")
        _write(folder / f"{record['id']}.data", data)
        _write(folder / f"{record['id']}.json", json.dumps(record).encode())
        return {**record, "bytes": len(data)}

    def file(self, tenant: str, file_id: str, param: str | None = None) -> dict[str, Any]:
        path = self._folder(tenant, "files") / f"{_checked_id(file_id, 'file-')}.json"
        if not path.is_file():
            raise StoreError("not_found", f"{param + ': ' if param else ''}no file {file_id!r}", param)
        return self._sized(tenant, json.loads(path.read_text()))

    def _sized(self, tenant: str, record: dict[str, Any]) -> dict[str, Any]:
        """A File object: its record, and its bytes as they are now (a batch's output files grow)."""
        return {**record, "bytes": self.content_path(tenant, record["id"]).stat().st_size}

    def content_path(self, tenant: str, file_id: str) -> Path:
        return self._folder(tenant, "files") / f"{_checked_id(file_id, 'file-')}.data"

    def content(self, tenant: str, file_id: str) -> bytes:
        self.file(tenant, file_id)
        return self.content_path(tenant, file_id).read_bytes()

    def files(self, tenant: str, purpose: str | None, after: str | None, limit: int, order: str) -> Page:
        records = [json.loads(path.read_text()) for path in self._folder(tenant, "files").glob("file-*.json")]
        files = [self._sized(tenant, record) for record in records if purpose is None or record["purpose"] == purpose]
        return _page(files, after, limit, descending=order == "desc")

    def delete_file(self, tenant: str, file_id: str) -> dict[str, Any]:
        """Delete a file, unless a batch that has not ended reads or writes it."""
        self.file(tenant, file_id)
        for batch in self._batch_records(tenant):
            if batch["status"] not in ENDED and file_id in (batch["input_file_id"], batch["output_file_id"], batch["error_file_id"]):
                raise StoreError(
                    "invalid_request", f"file {file_id!r} belongs to batch {batch['id']!r}, which is {batch['status']}: "
                    "cancel it, or wait for it to end, first",
                )
        for suffix in (".json", ".data"):
            (self._folder(tenant, "files") / f"{file_id}{suffix}").unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    def append(self, tenant: str, file_id: str, lines: list[str]) -> None:
        """Result lines appended to a batch's output or error file (counted against the tenant's bytes)."""
        with open(self.content_path(tenant, file_id), "a", encoding="utf-8") as out:
            out.write("".join(f"{line}\n" for line in lines))

    def tenant_bytes(self, tenant: str) -> int:
        return sum(path.stat().st_size for path in self._folder(tenant, "files").glob("file-*.data"))

    # -- batches ------------------------------------------------------------------------------
    def create_batch(self, tenant: str, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise StoreError("invalid_request", "the body is a JSON object")
        unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"})
        if unknown:
            raise StoreError("invalid_request", f"{unknown[0]}: unrecognized field", unknown[0])
        endpoint, window, metadata = body.get("endpoint"), body.get("completion_window"), body.get("metadata")
        if endpoint not in BATCH_URLS:
            raise StoreError("invalid_request", f"endpoint: {endpoint!r}; a batch runs {', '.join(BATCH_URLS)}", "endpoint")
        if window not in COMPLETION_WINDOWS:
            raise StoreError("invalid_request", f"completion_window: {window!r}; it is 24h", "completion_window")
        if metadata is not None and not (
            isinstance(metadata, dict) and len(metadata) <= 16
            and all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items())
        ):
            raise StoreError("invalid_request", "metadata: at most 16 string keys (64 characters) and values (512)", "metadata")
        input_file = body.get("input_file_id")
        if not isinstance(input_file, str):
            raise StoreError("invalid_request", "input_file_id: a file id is required", "input_file_id")
        if self.file(tenant, input_file, "input_file_id")["purpose"] != "batch":
            raise StoreError("invalid_request", "input_file_id: the file's purpose is not batch", "input_file_id")
        now = int(time.time())
        batch = {
            "id": f"batch_{secrets.token_hex(12)}", "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_file, "completion_window": window, "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
            "expires_at": now + COMPLETION_WINDOWS[window], "finalizing_at": None, "completed_at": None, "failed_at": None,
            "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata, "model": None,
            "usage": {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
                      "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0},
        }
        self.save_batch(tenant, batch)
        return batch

    def batch(self, tenant: str, batch_id: str) -> dict[str, Any]:
        path = self._folder(tenant, "batches") / f"{_checked_id(batch_id, 'batch_')}.json"
        if not path.is_file():
            raise StoreError("not_found", f"no batch {batch_id!r}")
        return json.loads(path.read_text())

    def batches(self, tenant: str, after: str | None, limit: int) -> Page:
        return _page(self._batch_records(tenant), after, limit, descending=True)

    def _batch_records(self, tenant: str) -> list[dict[str, Any]]:
        return [json.loads(path.read_text()) for path in self._folder(tenant, "batches").glob("batch_*.json")]

    def save_batch(self, tenant: str, batch: dict[str, Any]) -> None:
        _write(self._folder(tenant, "batches") / f"{batch['id']}.json", json.dumps(batch).encode())

    def cancel_batch(self, tenant: str, batch_id: str) -> dict[str, Any]:
        batch = self.batch(tenant, batch_id)
        if batch["status"] in ("validating", "in_progress"):
            batch["status"], batch["cancelling_at"] = "cancelling", int(time.time())
            self.save_batch(tenant, batch)
        elif batch["status"] not in ("cancelling", "cancelled"):
            raise StoreError("invalid_request", f"batch {batch_id!r} is {batch['status']}: it cannot be cancelled")
        return batch

    def unfinished(self) -> list[tuple[str, dict[str, Any]]]:
        """Every tenant's batches that have not ended, oldest first, each with its tenant."""
        found = []
        for path in self.root.glob("t-*/batches/batch_*.json"):
            batch = json.loads(path.read_text())
            if batch["status"] not in ENDED:
                found.append(((path.parent.parent / TENANT_FILE).read_text(), batch))
        return sorted(found, key=lambda item: item[1]["created_at"])

    def new_output_file(self, tenant: str, filename: str) -> dict[str, Any]:
        return self._new_file(tenant, filename, OUTPUT_PURPOSE)

    def _folder(self, tenant: str, kind: str) -> Path:
        """A tenant's folder of files or batches, in the tenant's own folder: named by a digest of the tenant's id
        (any id makes a safe name), which it keeps in TENANT_FILE."""
        home = self.root / ("t-" + hashlib.sha256(tenant.encode()).hexdigest()[:32])
        folder = home / kind
        if not folder.is_dir():
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            _write(home / TENANT_FILE, tenant.encode())
        return folder


def _checked_id(value: str, prefix: str) -> str:
    """An id as this store makes them (its prefix, then hex digits): anything else names nothing here."""
    rest = value[len(prefix):] if isinstance(value, str) and value.startswith(prefix) else ""
    if len(rest) != 24 or any(c not in "0123456789abcdef" for c in rest):
        raise StoreError("not_found", f"no such object {value!r}")
    return value


def _page(objects: list[dict[str, Any]], after: str | None, limit: int, descending: bool) -> Page:
    objects.sort(key=lambda o: (o["created_at"], o["id"]), reverse=descending)
    if after is not None:
        ids = [o["id"] for o in objects]
        objects = objects[ids.index(after) + 1:] if after in ids else []
    return Page(objects[:limit], len(objects) > limit)
