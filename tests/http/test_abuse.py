"""Cheap requests that cost the server a lot: each is refused before its work starts (or does bounded work), the
ingress's event loop keeps serving meanwhile, and the engine ends with every page back and still exact."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from serve_app import GenerateRequest, InferenceEngine
from serve_app.bench.idle import wait_idle
from serve_app.config import ServerConfig
from tests.inprocess import MODEL, InProcessServer, engine_server
from tests.references import ReferenceModel

USER = {"role": "user", "content": "Name a fruit."}


class LoopLag:
    """The worst delay of a 5 ms sleep on the server's event loop while the block runs."""

    def __init__(self, server: InProcessServer) -> None:
        self.loop = server._server.servers[0].get_loop()
        self.worst = 0.0
        self._stop = threading.Event()

    async def _probe(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            await asyncio.sleep(0.005)
            self.worst = max(self.worst, time.perf_counter() - start - 0.005)

    def __enter__(self) -> LoopLag:
        self._future = asyncio.run_coroutine_threadsafe(self._probe(), self.loop)
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._future.result(5)


@pytest.fixture(scope="module")
def server(engine: InferenceEngine) -> Iterator[InProcessServer]:
    with engine_server(engine, ServerConfig(max_choices=64)) as srv:
        yield srv


def _post(server: InProcessServer, route: str, body: object, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{route}", json=body, timeout=60, **kwargs)


def _refused(response: httpx.Response, status: int, param: str | None, words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    if param is not None and "param" in error:
        assert error["param"] == param, error
    assert words in error["message"], error
    return error


@pytest.mark.parametrize(
    ("route", "body", "param", "words"),
    [
        ("/v1/chat/completions", {"messages": [USER], "top_k": 2**70}, "top_k", "over the vocabulary's 49152 tokens"),
        ("/v1/messages", {"messages": [USER], "max_tokens": 4, "top_k": 2**70}, "top_k", "vocabulary"),
        ("/v1/completions", {"prompt": [1, 2, 2**63]}, "prompt", f"token id {2**63} is outside the vocabulary"),
        ("/v1/completions", {"prompt": [1, 2, 49152]}, "prompt", "token id 49152 is outside the vocabulary"),
        ("/v1/chat/completions", {"messages": [USER], "stop_token_ids": [2**40]}, "stop_token_ids", "outside the vocabulary"),
        ("/v1/chat/completions", {"messages": [USER], "seed": 2**70}, "seed", "less than or equal"),
        ("/v1/completions", {"prompt": [[1, 2]] * 500, "n": 16}, "prompt", "500 prompts x n=16 make 8000 choices, over max_choices=64"),
        ("/v1/chat/completions", {"messages": [USER], "n": 10**9}, "n", "over max_n=16"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a " * 20_000}]}, "messages", "max_prompt_characters=32768"),
        ("/v1/completions", {"prompt": "a" * 40_000}, "prompt", "over max_prompt_characters=32768"),
        ("/v1/chat/completions", {"messages": [USER], "response_format": {"type": "json_schema", "json_schema": {
            "name": "big", "schema": {"type": "string", "enum": [f"{i:060d}" for i in range(2000)]}}}},
         "response_format.json_schema.schema", "over max_grammar_bytes=32768"),
    ],
)
def test_a_costly_shape_is_refused_before_its_work(server: InProcessServer, route: str, body: dict, param: str, words: str) -> None:
    started = time.perf_counter()
    response = _post(server, route, {"model": MODEL, "max_tokens": 4, **body})
    _refused(response, 400, param, words)
    assert time.perf_counter() - started < 5


def test_the_event_loop_keeps_serving_while_a_big_body_is_refused(server: InProcessServer) -> None:
    """480 prompts of 1,000 token ids (a body just under max_request_bytes, 1 MiB): parsed and checked off the loop."""
    prompts = [[1] * 1000] * 480
    with LoopLag(server) as lag:
        response = _post(server, "/v1/completions", {"model": MODEL, "prompt": prompts, "max_tokens": 1})
    _refused(response, 400, "prompt", "480 prompts x n=1 make 480 choices, over max_choices=64")
    print(f"worst event-loop delay: {lag.worst * 1000:.1f} ms")
    assert lag.worst < 0.2, f"the event loop stalled for {lag.worst:.3f} s"


@pytest.mark.parametrize(
    ("headers", "said"),
    [({"content-type": "text/plain"}, "'text/plain'"), ({"content-type": "application/x-www-form-urlencoded"}, "form"),
     ({}, "no content-type")],
)
def test_only_json_bodies_reach_a_json_route(server: InProcessServer, headers: dict, said: str) -> None:
    """What a web page may send to another site without asking first is refused (415), so it cannot drive the server."""
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}' % MODEL.encode()
    for route in ("/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/kv/lookup"):
        response = httpx.post(f"{server.url}{route}", content=body, headers=headers, timeout=30)
        error = _refused(response, 415, None, "takes application/json bodies")
        assert said.strip("'") in error["message"] or said == "form"
    assert _post(server, "/v1/chat/completions", {"model": MODEL, "messages": [USER], "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize(
    "sampling", [{"repetition_penalty": 1e-308}, {"temperature": 1e-308}, {"temperature": 1e-308, "top_k": 49152}]
)
def test_extreme_sampling_values_sample_and_leave_the_batch_exact(
    engine: InferenceEngine, reference: ReferenceModel, sampling: dict
) -> None:
    """Values the API allows at its edges give tokens (a near-zero temperature: the top token), in the same batch as
    a greedy request whose tokens stay the reference's."""
    prompt = engine.tokenizer.encode("The capital of France is")
    expected = reference.greedy(prompt, 8)
    edge = GenerateRequest(prompt=prompt, max_tokens=8, ignore_eos=True, seed=1, **sampling)
    greedy = GenerateRequest(prompt=prompt, max_tokens=8, ignore_eos=True, temperature=0)
    streams = engine.loop.call(lambda: [engine.submit(edge), engine.submit(greedy)])
    odd, exact = [stream.wait(60) for stream in streams]
    assert odd.finish_reason == "length" and len(odd.token_ids) == 8
    assert exact.token_ids == expected
    if "temperature" in sampling:
        assert odd.token_ids == expected  # the top token, step after step


def test_count_tokens_is_bounded_and_refused_cheaply(server: InProcessServer) -> None:
    big = {"model": MODEL, "messages": [{"role": "user", "content": "a " * 20_000}]}
    _refused(_post(server, "/v1/messages/count_tokens", big), 400, None, "max_prompt_characters=32768")
    ok = _post(server, "/v1/messages/count_tokens", {"model": MODEL, "messages": [USER]})
    assert ok.status_code == 200 and ok.json()["input_tokens"] > 0


def test_the_engine_is_idle_with_every_page_back(server: InProcessServer, engine: InferenceEngine) -> None:
    wait_idle(engine.get_stats)  # nothing running or waiting, every page free
    assert server.context.slots.in_flight(server.context.tenants.authenticate(None)) == 0
