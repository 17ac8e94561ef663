"""The KV routes and the Python KV SDK over HTTP, against the in-process server and its engine."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from serve_app import GenerateRequest, InferenceEngine
from serve_app.config import ServerConfig
from serve_app.http.context import ServerContext
from serve_app.http.protocols.kv import MEDIA_TYPE, encode_kv
from serve_app.http.tenants import OPEN
from serve_app.kvsdk import (
    BatchedStream,
    KVContext,
    RequestStreamError,
    connect,
    create_request,
    make_post_completion,
)
from tests.inprocess import MODEL, InProcessServer, engine_server
from tests.prompts import _PASSAGE

PAGE = 16
ROOT = Path(__file__).resolve().parents[2]
GREEDY = {"temperature": 0, "ignore_eos": True}
MAX_KV_BYTES = 16 * 2**20


@pytest.fixture(scope="module")
def server(engine: InferenceEngine) -> Iterator[InProcessServer]:
    with engine_server(engine, ServerConfig(max_request_bytes=64 * 1024, max_kv_bytes=MAX_KV_BYTES)) as srv:
        yield srv


@pytest.fixture(scope="module")
def context(server: InProcessServer) -> ServerContext:
    return server.context


@pytest.fixture(scope="module")
def ctx(server: InProcessServer) -> KVContext:
    return connect(server.url)


@pytest.fixture(scope="module")
def post(server: InProcessServer):
    return make_post_completion(server.url)


@pytest.fixture(scope="module")
def prompt(engine: InferenceEngine) -> list[int]:
    ids = engine.tokenizer.encode(_PASSAGE * 2 + "One night, the keeper")
    assert len(ids) % PAGE != 0
    return ids


def test_config_route_matches_the_engine(ctx: KVContext, engine: InferenceEngine) -> None:
    assert ctx.config == engine.kv.config()
    assert ctx.page_size == PAGE


def test_lookup_retrieve_store_round_trip(
    ctx: KVContext, post, engine: InferenceEngine, context: ServerContext, prompt: list[int]
) -> None:
    out = post(prompt, {"max_tokens": 1, **GREEDY}, "http-a")
    assert len(out.token_ids) == 1 and out.metrics.input_tokens == len(prompt)
    cached = len(prompt) // PAGE * PAGE
    assert ctx.lookup(prompt, "http-a") == cached
    kv = ctx.retrieve(prompt, "http-a")
    # The server derives the engine's salt from the caller and the client's salt.
    assert engine.kv.retrieve(prompt, "http-a") is None
    assert kv is not None and torch.equal(kv, engine.kv.retrieve(prompt, context.tenants.tenant_salt(OPEN, "http-a")))
    assert ctx.store_pages(kv, prompt[:cached], "http-b") == {
        "stored": True, "stored_pages": cached // PAGE, "deduplicated_pages": 0,
    }
    assert ctx.store(kv, prompt[:cached], "http-b") is False
    assert ctx.lookup(prompt, "http-b") == cached
    assert ctx.retrieve(prompt, "http-nothing") is None


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param"}
    return error


def test_bad_kv_requests_get_400_naming_the_problem(
    server: InProcessServer, ctx: KVContext, post, prompt: list[int]
) -> None:
    post(prompt, {"max_tokens": 1, **GREEDY}, "http-bad")
    kv = ctx.retrieve(prompt, "http-bad")
    assert kv is not None
    tokens = prompt[: kv.shape[2]]
    store = f"{server.url}/v1/kv/store"
    headers = {"content-type": MEDIA_TYPE}
    cases = [
        (encode_kv(kv, tokens[:-1], "s"), "tokens", "tokens for KV of"),
        (encode_kv(kv[:, 1:], tokens, "s"), "kv", "shape"),
        (encode_kv(kv.half(), tokens, "s"), "kv", "dtype float16"),
        (encode_kv(kv), "tokens", "no tensor named 'tokens'"),
        (b"not a safetensors file", "body", "not a safetensors file"),
    ]
    for body, param, words in cases:
        error = _error(httpx.post(store, content=body, headers=headers), 400)
        assert error["param"] == param and words in error["message"], error
    error = _error(httpx.post(store, content=b"x" * (MAX_KV_BYTES + 1), headers=headers), 413)
    assert "max_kv_bytes" in error["message"]
    error = _error(httpx.post(f"{server.url}/v1/kv/retrieve", json={"tokens": prompt, "cache_salt": "none"}), 404)
    assert error["type"] == "not_found_error"
    for body in ({"tokens": "abc"}, {"tokens": []}, [1, 2], {"tokens": [1], "extra": 1}):
        _error(httpx.post(f"{server.url}/v1/kv/lookup", json=body), 400)
    # Still serving.
    assert len(post(prompt[:20], {"max_tokens": 3, **GREEDY}, "").token_ids) == 3


def test_completions_return_token_ids(server: InProcessServer, engine: InferenceEngine, prompt: list[int]) -> None:
    body = {"model": MODEL, "prompt": prompt[:40], "max_tokens": 6, **GREEDY, "return_token_ids": True}
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    result = engine.submit(GenerateRequest(prompt=prompt[:40], max_tokens=6, **GREEDY))
    expected = list(result.wait(60).token_ids)
    assert whole["choices"][0]["token_ids"] == expected
    streamed: list[int] = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                streamed.extend(json.loads(line[6:])["choices"][0]["token_ids"])
    assert streamed == expected
    plain = httpx.post(f"{server.url}/v1/completions", json={**body, "return_token_ids": False}, timeout=60).json()
    assert "token_ids" not in plain["choices"][0]


def test_identity_modify_keeps_the_greedy_output(ctx: KVContext, post, prompt: list[int]) -> None:
    modified = create_request(ctx, post, prompt, cache_salt="identity-a")
    modified.generate({"max_tokens": 1, **GREEDY})
    metrics = modified.modify_kv(lambda kv, tokens: (kv, tokens))
    cached = len(prompt) // PAGE * PAGE
    assert metrics.input_tokens == cached and modified.tokens == prompt[:cached]
    assert modified.suffix_tokens == prompt[cached:] + modified.decoded_tokens
    modified.generate({"max_tokens": 10, **GREEDY})
    plain = create_request(ctx, post, prompt, cache_salt="identity-b")
    plain.generate({"max_tokens": 1, **GREEDY})
    plain.generate({"max_tokens": 10, **GREEDY})
    assert modified.decoded_tokens == plain.decoded_tokens and len(plain.decoded_tokens) == 11
    assert modified.output_text == plain.output_text and not modified.is_done


def test_modified_prefix_is_read_and_only_the_suffix_prefilled(
    ctx: KVContext, post, engine: InferenceEngine, prompt: list[int]
) -> None:
    stream = create_request(ctx, post, prompt, cache_salt="drop-one")
    stream.generate({"max_tokens": 1, **GREEDY})

    def drop_first_page(kv: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
        return kv[:, :, PAGE:], tokens[PAGE:]

    stream.modify_kv(drop_first_page)
    suffix = list(stream.suffix_tokens)
    before = engine.get_stats()
    metrics = stream.generate({"max_tokens": 4, **GREEDY})
    after = engine.get_stats()
    assert metrics.input_tokens == len(prompt) - PAGE + 1
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(suffix)
    assert stream.tokens[: len(prompt) - PAGE] == prompt[PAGE:]


def test_batched_stream_runs_phases(ctx: KVContext, post, prompt: list[int], capsys: pytest.CaptureFixture) -> None:
    batch = BatchedStream(create_request(ctx, post, prompt[: 40 + 9 * i], cache_salt=f"batch-{i}") for i in range(3))
    prefill = batch.prefill({"temperature": 0, "max_tokens": 50})
    assert prefill.output_tokens == 3 and len(prefill.streams) == 3
    modify = batch.modify(lambda kv, tokens: (kv, tokens))
    assert modify.input_tokens == sum(len(prompt[: 40 + 9 * i]) // PAGE * PAGE for i in range(3))
    decode = batch.decode({"max_tokens": 5, **GREEDY})
    assert decode.output_tokens == 15
    for key in decode.streams:
        stream = batch.get_request_stream(key)
        assert len(stream.decoded_tokens) == 6 and stream.request_stream_id == key
    data = decode.to_dict()
    assert data["phase"] == "decode" and data["streams"] == 3 and data["tpot_p50_s"] > 0
    decode.emit()
    assert "== decode ==" in capsys.readouterr().out


def test_stream_failures_raise_with_the_stream_id(ctx: KVContext, post, prompt: list[int]) -> None:
    stream = create_request(ctx, post, prompt[:30], cache_salt="failing")
    with pytest.raises(RequestStreamError) as failure:
        stream.generate({"max_tokens": 10**6})
    assert failure.value.request_stream_id == stream.request_stream_id and "max_tokens" in str(failure.value)
    short = create_request(ctx, post, prompt[:5], cache_salt="too-short")
    short.generate({"max_tokens": 1, **GREEDY})
    with pytest.raises(RequestStreamError, match="no whole page"):
        short.retrieve(timeout=0.5)


def test_token_dropping_example_runs(server: InProcessServer, tmp_path: Path) -> None:
    out = tmp_path / "dropping.json"
    command = [
        sys.executable, str(ROOT / "examples" / "token_dropping.py"), "--url", server.url,
        "--prompts", "2", "--prompt-tokens", "150", "--max-tokens", "6", "--json", str(out),
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    full, dropped = report["without dropping"], report["with dropping"]
    assert [p["phase"] for p in dropped["phases"]] == ["prefill", "modify", "decode"]
    for before, after in zip(full["context_tokens"], dropped["context_tokens"]):
        assert after < before
    assert all(full["outputs"]) and all(dropped["outputs"])
    assert report["decode_speedup"] > 0 and "decode TPOT p50" in run.stdout
