"""Tenants: API keys from a file, who a caller is, and the cache salt the server derives for them.

A cache hit makes the first token come sooner, so a prefix cache shared between users leaks
their prompts through timing. The engine's cache salt is therefore never the client's: it is
an HMAC, under a server secret, of the caller's tenant id and the client's own `cache_salt`
(which thus only subdivides its tenant's cache).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

KEYS_ENV = "SERVE_APP_API_KEYS"
MAX_CLIENT_SALT = 128
Role = Literal["user", "admin"]


@dataclass(frozen=True)
class Tenant:
    id: str
    role: Role

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


# Who every caller is when no keys are configured (the server runs open, for local use): an admin where only this
# machine can reach the server, else `OPEN_GENERATION` (generation only, no KV or admin routes).
OPEN = Tenant(id="", role="admin")
OPEN_GENERATION = Tenant(id="", role="user")


class _KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str
    role: Role = "user"


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def load_keys(path: Path) -> dict[str, Tenant]:
    """`{sha256 hex of a key: Tenant}` from a YAML or JSON mapping of keys (or `sha256:<hex>`) to entries."""
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(data, Mapping) or not data:
        raise ValueError(f"{path}: expected a non-empty mapping of API keys to {{tenant, role}}")
    keys: dict[str, Tenant] = {}
    for key, entry in data.items():
        try:
            parsed = _KeyEntry.model_validate(entry)
        except ValidationError as error:
            raise ValueError(f"{path}: the entry of a key is invalid: {error.errors()[0]['msg']}") from None
        if not parsed.tenant:
            raise ValueError(f"{path}: a key has an empty tenant id")
        key = str(key)
        digest = key.removeprefix("sha256:").lower() if key.startswith("sha256:") else key_digest(key)
        keys[digest] = Tenant(parsed.tenant, parsed.role)
    return keys


def check_client_salt(salt: str) -> str:
    """A client's `cache_salt`: a non-empty string of at most 128 characters, no control characters."""
    if not salt:
        raise ValueError("must be a non-empty string")
    if len(salt) > MAX_CLIENT_SALT:
        raise ValueError(f"must be at most {MAX_CLIENT_SALT} characters, got {len(salt)}")
    if any(unicodedata.category(ch) == "Cc" for ch in salt):
        raise ValueError("must not contain control characters")
    return salt


class TenantDirectory:
    """Authenticates callers by API key and derives their cache salts."""

    def __init__(self, keys: dict[str, Tenant], secret: str, open_tenant: Tenant = OPEN) -> None:
        self._keys = keys
        self._secret = secret.encode("utf-8")
        self.open_tenant = open_tenant  # who every caller is without keys

    @classmethod
    def open(cls) -> TenantDirectory:
        """No keys: every caller is the one open tenant."""
        return cls({}, secrets.token_hex(32))

    @property
    def auth_enabled(self) -> bool:
        return bool(self._keys)

    def key_entries(self) -> dict[str, dict[str, str]]:
        """The keys as `load_keys` reads them (`{sha256 hex: {tenant, role}}`): what a replica is handed."""
        return {digest: {"tenant": t.id, "role": t.role} for digest, t in self._keys.items()}

    @staticmethod
    def keys_from_entries(entries: Mapping[str, Mapping[str, str]]) -> dict[str, Tenant]:
        return {digest: Tenant(entry["tenant"], entry["role"]) for digest, entry in entries.items()}  # type: ignore[arg-type]

    def authenticate(self, key: str | None) -> Tenant | None:
        """The caller's tenant; None for a missing or unknown key while auth is on."""
        if not self._keys:
            return self.open_tenant
        if not key:
            return None
        return self._keys.get(key_digest(key))

    def tenant_salt(self, tenant: Tenant, client_salt: str = "") -> str:
        """The salt of `tenant`'s pages, subdivided by the client's own salt."""
        message = b"tenant\x00" + tenant.id.encode("utf-8") + b"\x00salt\x00" + client_salt.encode("utf-8")
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()


class TenantSlots:
    """Requests in flight per tenant, at most `limit` each (one event loop's count: no lock needed)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._in_flight: dict[str, int] = {}

    def try_take(self, tenant: Tenant) -> bool:
        count = self._in_flight.get(tenant.id, 0)
        if count >= self.limit:
            return False
        self._in_flight[tenant.id] = count + 1
        return True

    def give_back(self, tenant: Tenant) -> None:
        count = self._in_flight.get(tenant.id, 0) - 1
        if count > 0:
            self._in_flight[tenant.id] = count
        else:
            self._in_flight.pop(tenant.id, None)

    def in_flight(self, tenant: Tenant) -> int:
        return self._in_flight.get(tenant.id, 0)
