"""Property-based fuzzing of every POST route: never a 500, every error in the route's own shape.

Bodies come in four classes: arbitrary JSON values, valid requests with one field replaced by
an arbitrary value (or dropped, or joined by an unknown one), raw bytes (invalid UTF-8,
truncated JSON, deep nesting, oversize), and random safetensors-like bytes for the KV store.
The server must still answer a greedy request exactly afterwards.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_app import GenerateRequest, InferenceEngine
from serve_app.config import ServerConfig
from tests.inprocess import MODEL, engine_server

MAX_BYTES = 16 * 1024
USER = {"role": "user", "content": "Hi"}
VALID = {
    "/v1/chat/completions": {"model": MODEL, "messages": [USER], "max_tokens": 2},
    "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
    "/v1/messages": {"model": MODEL, "messages": [USER], "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [USER]},
    "/v1/kv/lookup": {"tokens": [1, 2, 3]},
    "/v1/kv/retrieve": {"tokens": [1, 2, 3]},
}
ROUTES = [*VALID, "/v1/kv/store"]
ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def client(engine: InferenceEngine) -> Iterator[httpx.Client]:
    # Every generation is bounded (a body without max_tokens would otherwise run to the context's end).
    config = ServerConfig(max_request_bytes=MAX_BYTES, max_output_tokens=4)
    with engine_server(engine, config) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        yield http


def check(client: httpx.Client, route: str, content: bytes) -> None:
    """Post `content`; the answer is a success or a client error in the route's own error shape."""
    response = client.post(route, content=content, headers={"content-type": "application/json"})
    assert response.status_code < 500, (route, content[:200], response.text[:300])
    if response.status_code < 400:
        return
    data = response.json()
    error = data["error"]
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    if route in ANTHROPIC:
        assert data["type"] == "error"
    else:
        assert "param" in error and error["code"] == response.status_code


@FUZZ
@given(route=st.sampled_from(ROUTES), body=json_values)
def test_arbitrary_json_bodies(client: httpx.Client, route: str, body: object) -> None:
    check(client, route, json.dumps(body).encode())


@FUZZ
@given(
    route=st.sampled_from(list(VALID)),
    data=st.data(),
    value=json_values,
    action=st.sampled_from(["replace", "drop", "add"]),
)
def test_valid_bodies_with_one_field_changed(client: httpx.Client, route: str, data, value: object, action: str) -> None:
    body = dict(VALID[route])
    field = data.draw(st.sampled_from(sorted(body)))
    if action == "replace":
        body[field] = value
    elif action == "drop":
        del body[field]
    else:
        body[data.draw(st.text(min_size=1, max_size=12))] = value
    check(client, route, json.dumps(body).encode())


raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.binary(min_size=1, max_size=32).map(lambda b: b"\xff\xfe" + b),
    st.sampled_from([b"", b"{", b'{"model": ', b"[" * 5000 + b"]" * 5000, b'{"a": ' * 3000 + b"1" + b"}" * 3000]),
    st.just(b'{"model": "' + b"x" * (MAX_BYTES + 1) + b'"}'),
)


@FUZZ
@given(route=st.sampled_from(ROUTES), body=raw_bodies)
def test_raw_bytes(client: httpx.Client, route: str, body: bytes) -> None:
    check(client, route, body)


@FUZZ
@given(body=st.binary(max_size=256).map(lambda b: len(b).to_bytes(8, "little") + b))
def test_kv_store_with_bytes_that_look_like_safetensors(client: httpx.Client, body: bytes) -> None:
    check(client, "/v1/kv/store", body)


def test_still_serving_and_correct_after_fuzzing(client: httpx.Client, engine: InferenceEngine) -> None:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    response = client.post("/v1/completions", json=body)
    expected = engine.generate_with_request(GenerateRequest(prompt=body["prompt"], max_tokens=4, temperature=0))
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected
