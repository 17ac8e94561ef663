"""Tenants: API keys, 401/403 in each protocol's shape, and prompt caches that never mix across tenants."""

from __future__ import annotations

import json
import logging
import stat
from dataclasses import asdict
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import yaml

from deployments.access import ServerAccess, read_access
from serve_app import InferenceEngine
from serve_app.config import ServerConfig
from serve_app.http.tenants import OPEN, OPEN_GENERATION, Tenant, TenantDirectory, key_digest, load_keys
from tests.inprocess import MODEL, InProcessServer, engine_server
from tests.prompts import _PASSAGE

KEYS = {
    "key-a": {"tenant": "acme", "role": "user"},
    f"sha256:{key_digest('key-b')}": {"tenant": "globex"},
    "key-admin": {"tenant": "ops", "role": "admin"},
}


@pytest.fixture(scope="module")
def server(engine: InferenceEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    keys_file = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys_file.write_text(yaml.safe_dump(KEYS))
    tenants = TenantDirectory(load_keys(keys_file), "test-secret")
    with engine_server(engine, tenants=tenants) as srv:
        yield srv


def oai(server: InProcessServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def test_keys_load_from_yaml_and_json_with_hashed_entries(tmp_path: Path) -> None:
    for name, dump in (("keys.yaml", yaml.safe_dump), ("keys.json", json.dumps)):
        path = tmp_path / name
        path.write_text(dump(KEYS))
        keys = load_keys(path)
        assert keys[key_digest("key-a")] == Tenant("acme", "user")
        assert keys[key_digest("key-b")] == Tenant("globex", "user")
        assert keys[key_digest("key-admin")].is_admin
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"k": {"tenant": "t", "role": "root"}}))
    with pytest.raises(ValueError, match="bad.yaml"):
        load_keys(bad)


@pytest.mark.parametrize(("host", "mode", "admin"), [
    ("127.0.0.1", "loopback", True), ("localhost", "loopback", True), ("::1", "loopback", True),
    ("0.0.0.0", "loopback", False), ("10.0.0.5", "loopback", False), (None, "loopback", False),
    ("0.0.0.0", "anywhere", True),
])
def test_without_keys_the_server_is_open_and_says_so(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, host: str | None, mode: str, admin: bool
) -> None:
    """Open mode serves the KV and admin routes only where nobody else reaches the server, unless the config opts in."""
    monkeypatch.delenv("SERVE_APP_API_KEYS", raising=False)
    monkeypatch.setenv("SERVE_APP_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING):
        access = read_access(ServerConfig(open_mode_admin=mode), host)
    tenants = access.tenants()
    assert not tenants.auth_enabled and tenants.authenticate(None) == (OPEN if admin else OPEN_GENERATION)
    assert "no API keys configured" in caplog.text
    assert ("serving generation only" in caplog.text) is not admin


def test_keys_and_the_salt_secret_are_read_once_at_build_and_the_secret_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump(KEYS))
    monkeypatch.setenv("SERVE_APP_API_KEYS", str(keys))
    monkeypatch.setenv("SERVE_APP_CACHE_DIR", str(tmp_path / "cache"))
    first = read_access(ServerConfig(), "0.0.0.0")
    keys.unlink()  # a replica never reads the file: it is handed the digests
    tenants = ServerAccess(**asdict(first)).tenants()
    assert tenants.authenticate("key-a") == Tenant("acme", "user") and tenants.authenticate("sk-nope") is None
    assert "key-a" not in json.dumps(asdict(first))  # only digests travel
    kept = tmp_path / "cache" / "cache-salt-secret"
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    monkeypatch.delenv("SERVE_APP_API_KEYS")
    again = read_access(ServerConfig(), "127.0.0.1")  # a later deploy derives the same salts
    assert again.secret == first.secret == kept.read_text()
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-a-secret\n")
    assert read_access(ServerConfig(cache_salt_secret_file=str(secret_file)), None).secret == "from-a-secret"
    assert read_access(ServerConfig(cache_salt_secret="given"), None).secret == "given"


def test_salts_depend_on_tenant_client_salt_and_secret() -> None:
    one, other = TenantDirectory({}, "s1"), TenantDirectory({}, "s2")
    acme, globex = Tenant("acme", "user"), Tenant("globex", "user")
    salts = {one.tenant_salt(acme), one.tenant_salt(globex), one.tenant_salt(acme, "x"), other.tenant_salt(acme)}
    assert len(salts) == 4
    assert one.tenant_salt(acme, "x") == TenantDirectory({}, "s1").tenant_salt(acme, "x")
    # A client salt cannot pose as another tenant's: the tenant id is fenced off from it.
    assert one.tenant_salt(Tenant("a", "user"), "cme") != one.tenant_salt(Tenant("acme", "user"))


def test_missing_or_unknown_keys_get_401_in_each_protocol_shape(server: InProcessServer) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"x-api-key": "nope"}):
        response = httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        oai(server, "nope").chat.completions.create(**chat)
    claude = anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as failure:
        claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert failure.value.body["error"]["type"] == "authentication_error"
    # Both headers work on both APIs.
    assert oai(server, "key-a").chat.completions.create(**chat).choices[0].message.content is not None
    message = httpx.post(
        f"{server.url}/v1/messages",
        json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
        headers={"Authorization": "Bearer key-b"},
    )
    assert message.status_code == 200 and message.json()["type"] == "message"
    response = httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers={"x-api-key": "key-b"})
    assert response.status_code == 200
    # An empty x-api-key (a client library's default) does not hide the Bearer key.
    both = {"x-api-key": "", "Authorization": "Bearer key-a"}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers=both).status_code == 200


def test_a_traces_endpoint_is_logged_without_its_credentials() -> None:
    from serve_app.metrics.tracing import without_credentials

    logged = without_credentials("https://user:s3cret@collector.example:4318/v1/traces?token=abc#x")
    assert logged == "https://collector.example:4318/v1/traces"


def test_health_is_open_and_admin_routes_need_an_admin(server: InProcessServer) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    for route in ("/stats", "/metrics", "/v1/kv/config"):
        assert httpx.get(f"{server.url}{route}").status_code == 401
        user = httpx.get(f"{server.url}{route}", headers={"Authorization": "Bearer key-a"})
        assert user.status_code == 403 and user.json()["error"]["type"] == "permission_error"
        assert httpx.get(f"{server.url}{route}", headers={"Authorization": "Bearer key-admin"}).status_code == 200
    lookup = httpx.post(f"{server.url}/v1/kv/lookup", json={"tokens": [1, 2]}, headers={"x-api-key": "key-a"})
    assert lookup.status_code == 403


def test_one_tenants_prompt_cache_is_invisible_to_another(server: InProcessServer, engine: InferenceEngine) -> None:
    prompt = f"{_PASSAGE * 2}Tenant isolation check: the keeper"
    ask = dict(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    first = oai(server, "key-a").completions.create(**ask)
    second = oai(server, "key-a").completions.create(**ask)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    hits = engine.get_stats()["prefix_cache_hit_tokens"]
    other = oai(server, "key-b").completions.create(**ask)
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert engine.get_stats()["prefix_cache_hit_tokens"] == hits
    # A client salt subdivides a tenant's own cache.
    salted = oai(server, "key-a").completions.create(**ask, extra_body={"cache_salt": "project-1"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("salt", ["", "x" * 129, "bad\x01salt", 7])
def test_bad_client_salts_are_400(server: InProcessServer, salt: object) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "cache_salt": salt}
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers={"x-api-key": "key-a"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt", response.text
