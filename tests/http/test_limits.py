"""Request limits: each breach is a 4xx in the route's own shape naming the limit; 429 per tenant."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from serve_app import InferenceEngine
from serve_app.bench.idle import wait_idle
from serve_app.config import ServerConfig
from serve_app.http.tenants import OPEN
from tests.inprocess import MODEL, InProcessServer, engine_server

LIMITS = dict(
    max_n=2, max_stop_sequences=2, max_stop_length=8, max_messages=3, max_output_tokens=8, max_concurrent_per_tenant=2
)
USER = {"role": "user", "content": "Hi"}


@pytest.fixture(scope="module")
def server(engine: InferenceEngine) -> Iterator[InProcessServer]:
    with engine_server(engine, ServerConfig(**LIMITS)) as srv:
        yield srv


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
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 9}, "max_output_tokens", "max_output_tokens=8"),
        ("/v1/responses", {"input": [USER] * 4}, "input", "max_messages=3"),
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
    with engine_server(engine, ServerConfig(max_concurrent_per_tenant=2)) as srv:
        yield srv


def test_a_tenant_over_its_concurrency_gets_429_with_retry_after(two_slot_server: InProcessServer) -> None:
    url = f"{two_slot_server.url}/v1/completions"
    long = {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 400, "ignore_eos": True, "stream": True}
    short = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    with httpx.Client(timeout=60) as client:
        before = two_slot_server.context.models.first.engine.get_stats()
        held = [client.stream("POST", url, json=long) for _ in range(2)]
        streams = [h.__enter__() for h in held]
        try:
            assert [s.status_code for s in streams] == [200, 200]
            refused = client.post(url, json=short)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["type"] == "rate_limit_error" and "max_concurrent_per_tenant=2" in error["message"]
            # Counting tokens is work too: it takes a slot like a generation.
            count = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
            counted = client.post(f"{two_slot_server.url}/v1/messages/count_tokens", json=count)
            assert counted.status_code == 429 and counted.json()["error"]["type"] == "rate_limit_error"
        finally:
            for handle in held:  # disconnecting cancels the requests
                handle.__exit__(None, None, None)
        deadline = time.monotonic() + 30
        while (again := client.post(url, json=short)).status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert again.status_code == 200
    after = wait_idle(two_slot_server.context.models.first.engine.get_stats)
    assert after["total_tokens"] - before["total_tokens"] < 2 * 400  # the held streams were cut short


@pytest.fixture(scope="module")
def one_seat_engine(tiny_llama_path: Path) -> Iterator[InferenceEngine]:
    """An engine that runs one request at a time and lets one more wait."""
    eng = InferenceEngine(compile=False, model=str(tiny_llama_path), max_num_seqs=1, max_waiting_requests=1, max_model_len=1024)
    yield eng
    eng.shutdown()


def test_past_the_engine_queue_bound_openai_gets_503_and_anthropic_529(one_seat_engine: InferenceEngine) -> None:
    long = {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 900, "ignore_eos": True, "stream": True}
    short = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}

    async def scenario(url: str) -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:

            async def hold() -> None:
                async with client.stream("POST", "/v1/completions", json=long) as response:
                    async for _ in response.aiter_lines():
                        pass

            async def until(key: str) -> None:
                deadline = time.monotonic() + 30
                while one_seat_engine.get_stats()[key] < 1:
                    assert time.monotonic() < deadline, (key, one_seat_engine.get_stats(), held)
                    await asyncio.sleep(0.01)

            held = [asyncio.create_task(hold())]  # it runs...
            await until("active_tasks")
            held.append(asyncio.create_task(hold()))  # ...and this one waits
            await until("waiting_queue")
            refused = await client.post("/v1/completions", json=short)
            overloaded = await client.post("/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": [USER]})
            for task in held:  # hanging up cancels both
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
            return refused, overloaded

    with engine_server(one_seat_engine) as server:
        refused, overloaded = asyncio.run(scenario(server.url))
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "max_waiting_requests=1" in refused.json()["error"]["message"]
        assert overloaded.status_code == 529 and overloaded.headers["retry-after"] == "1"
        error = overloaded.json()["error"]
        assert overloaded.json()["type"] == "error" and error["type"] == "overloaded_error"
        stats = wait_idle(one_seat_engine.get_stats)
        assert stats["total_tokens"] < 2 * 900
        assert httpx.post(f"{server.url}/v1/completions", json=short, timeout=60).status_code == 200


def test_a_client_gone_at_the_headers_gives_its_slot_back_and_cancels(
    two_slot_server: InProcessServer, engine: InferenceEngine
) -> None:
    """Starlette may stop a stream before reading its body; the slot and the request must not leak then."""
    body = json.dumps({"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 400, "ignore_eos": True, "stream": True})
    scope = {
        "type": "http", "http_version": "1.1", "method": "POST", "scheme": "http", "path": "/v1/completions",
        "raw_path": b"/v1/completions", "query_string": b"", "root_path": "", "server": ("127.0.0.1", 80),
        "client": ("127.0.0.1", 5555), "headers": [(b"content-type", b"application/json")],
    }
    before = engine.get_stats()

    async def leave_at_the_headers() -> list[str]:
        sent: list[str] = []
        requested = False

        async def receive() -> dict:
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": body.encode(), "more_body": False}
            return {"type": "http.disconnect"}  # the client is gone as soon as the body is read

        async def send(message: dict) -> None:
            sent.append(message["type"])
            if message["type"] == "http.response.start":
                await asyncio.sleep(0.5)  # a slow client: the disconnect is seen before the body is read

        await two_slot_server.app(scope, receive, send)
        return sent

    sent = asyncio.run(leave_at_the_headers())
    assert "http.response.body" not in sent  # the stream's body was never read
    assert two_slot_server.context.slots.in_flight(OPEN) == 0
    after = wait_idle(engine.get_stats, timeout=10)
    assert after["total_tasks"] - before["total_tasks"] == 1
    assert after["total_tokens"] - before["total_tokens"] < 400  # cancelled, not run to max_tokens
