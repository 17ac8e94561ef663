"""ServerAccess: who may call, read once where the application is built and handed to every ingress replica, so
that every node agrees: the API keys (as digests), the cache-salt secret (kept across deploys, so that cached
prefixes stay warm and tier pages stay reachable), and whether open mode serves the KV and admin routes (only
where Serve's HTTP listens on loopback alone, unless the config says `open_mode_admin: anywhere`)."""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import ray

from serve_app.config import ServerConfig, default_cache_dir
from serve_app.http.tenants import KEYS_ENV, OPEN, OPEN_GENERATION, TenantDirectory, load_keys

logger = logging.getLogger(__name__)

# Where the cache-salt secret is kept when the config names none: made once, readable by its owner only.
SECRET_FILE = "cache-salt-secret"


@dataclass(frozen=True)
class ServerAccess:
    keys: dict[str, dict[str, str]]  # sha256 hex of a key -> {tenant, role}
    secret: str
    open_admin: bool  # without keys, every caller may use the KV and admin routes

    def tenants(self) -> TenantDirectory:
        keys = TenantDirectory.keys_from_entries(self.keys)
        return TenantDirectory(keys, self.secret, OPEN if self.open_admin else OPEN_GENERATION)


def read_access(server: ServerConfig, http_host: str | None) -> ServerAccess:
    """The keys (`api_keys_file`, else the file `SERVE_APP_API_KEYS` names), the secret, and what open mode serves
    on `http_host` (None: unknown, taken as reachable from other machines). Warns once when the server is open."""
    path = server.api_keys_file or os.environ.get(KEYS_ENV)
    keys = TenantDirectory(load_keys(Path(path)), "").key_entries() if path else {}
    local = http_host is not None and is_loopback(http_host)
    open_admin = local or server.open_mode_admin == "anywhere"
    if not keys:
        where = f"HTTP on {http_host}" if http_host is not None else "HTTP on an unknown host"
        if open_admin:
            logger.warning("no API keys configured (%s unset), %s: anyone who can reach it may use every route", KEYS_ENV, where)
        else:
            logger.warning(
                "no API keys configured (%s unset), %s: serving generation only; the KV and admin routes need API "
                "keys (or open_mode_admin: anywhere)", KEYS_ENV, where,
            )
    return ServerAccess(keys, cache_salt_secret(server), open_admin)


def cache_salt_secret(server: ServerConfig) -> str:
    """`cache_salt_secret`, else the contents of `cache_salt_secret_file`, else the secret kept in the cache folder
    (made there, 0600, by the first build)."""
    if server.cache_salt_secret:
        return server.cache_salt_secret
    if server.cache_salt_secret_file:
        secret = Path(server.cache_salt_secret_file).read_text().strip()
        if not secret:
            raise ValueError(f"cache_salt_secret_file: {server.cache_salt_secret_file} is empty")
        return secret
    return kept_secret(default_cache_dir() / SECRET_FILE)


def kept_secret(path: Path) -> str:
    """The secret in `path`, made there first (readable by its owner only) if there is none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(descriptor, "w") as file:
        secret = secrets.token_hex(32)
        file.write(secret)
    return secret


def serve_http_host() -> str | None:
    """The host Serve's HTTP proxies listen on (`http_options.host`), asked of the Serve controller; None outside
    a Serve application's build."""
    if not ray.is_initialized():
        return None
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        return ray.get(controller.get_http_config.remote(), timeout=30).host
    except (ValueError, ray.exceptions.RayError):
        return None


def is_loopback(host: str) -> bool:
    """Whether only this machine reaches `host` (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
