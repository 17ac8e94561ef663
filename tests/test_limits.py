"""Request limits: each breach is a 4xx in the route's own shape naming the limit; 429 per tenant."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from serve_app import InferenceEngine
from serve_app.config import ServerConfig
from serve_app.protocols.engine_client import LocalEngineClient
from serve_app.server import ServerContext, create_api
from tests.inprocess import InProcessServer

MODEL = "smollm2-135m-instruct"
LIMITS = dict(
    max_n=2, max_stop_sequences=2, max_stop_length=8, max_messages=3, max_output_tokens=8, max_concurrent_per_tenant=2
)
USER = {"role": "user", "content": "Hi"}


@pytest.fixture(scope="module")
def server(engine: InferenceEngine) -> Iterator[InProcessServer]:
    context = ServerContext(LocalEngineClient(engine, MODEL), ServerConfig(**LIMITS))
    srv = InProcessServer(create_api(context))
    yield srv
    srv.stop()


def _post(server: InProcessServer, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{route}", json=body, timeout=60)


@pytest.mark.parametrize(
    ("route", "body", "param", "limit"),
    [
        ("/v1/chat/completions", {"messages": [USER], "n": 3}, "n", "max_n=2"),
        ("/v1/chat/completions", {"messages": [USER], "stop": ["a", "b", "c"]}, "stop", "max_stop_sequences=2"),
        ("/v1/completions", {"prompt": "Hi", "stop": "x" * 9}, "stop", "max_stop_length=8"),
        ("/v1/chat/completions", {"messages": [USER] * 4}, "messages", "max_messages=3"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 9}, "max_tokens", "max_output_tokens=8"),
        ("/v1/messages", {"messages": [USER], "max_tokens": 4, "stop_sequences": ["a", "b", "c"]},
         "stop_sequences", "max_stop_sequences=2"),
        ("/v1/messages", {"messages": [USER], "max_tokens": 9}, "max_tokens", "max_output_tokens=8"),
    ],
)
def test_each_limit_is_a_400_naming_it(server: InProcessServer, route: str, body: dict, param: str, limit: str) -> None:
    response = _post(server, route, {"model": MODEL, **body})
    assert response.status_code == 400, response.text
    data = response.json()
    error = data["error"]
    assert limit in error["message"]
    if route == "/v1/messages":
        assert data["type"] == "error" and error["type"] == "invalid_request_error"
    else:
        assert error["param"] == param and error["type"] == "invalid_request_error"


def test_requests_without_max_tokens_get_the_limit(server: InProcessServer) -> None:
    body = {"model": MODEL, "prompt": "Count: one, two,", "ignore_eos": True, "temperature": 0}
    response = _post(server, "/v1/completions", body)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8


@pytest.fixture(scope="module")
def two_slot_server(engine: InferenceEngine) -> Iterator[InProcessServer]:
    context = ServerContext(LocalEngineClient(engine, MODEL), ServerConfig(max_concurrent_per_tenant=2))
    srv = InProcessServer(create_api(context))
    yield srv
    srv.stop()


def test_a_tenant_over_its_concurrency_gets_429_with_retry_after(two_slot_server: InProcessServer) -> None:
    url = f"{two_slot_server.url}/v1/completions"
    long = {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 400, "ignore_eos": True, "stream": True}
    short = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    with httpx.Client(timeout=60) as client:
        held = [client.stream("POST", url, json=long) for _ in range(2)]
        streams = [h.__enter__() for h in held]
        try:
            assert [s.status_code for s in streams] == [200, 200]
            refused = client.post(url, json=short)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["type"] == "rate_limit_error" and "max_concurrent_per_tenant=2" in error["message"]
        finally:
            for handle in held:  # disconnecting cancels the requests
                handle.__exit__(None, None, None)
        deadline = time.monotonic() + 30
        while (again := client.post(url, json=short)).status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert again.status_code == 200
