"""The HTTP API in process (uvicorn + the in-process engine), driven by the official SDKs and raw HTTP."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from serve_app import GenerateRequest, InferenceEngine
from serve_app.config import ServerConfig
from serve_app.http.engine_client import LocalEngineClient
from tests.inprocess import MODEL, InProcessServer, engine_server
from tests.served import metric_samples

CHAT = [{"role": "user", "content": "Name three fruits."}]


class NotReadyClient(LocalEngineClient):
    """The engine client of a server whose engine has not finished loading."""

    async def ready(self) -> bool:
        return False


@pytest.fixture(scope="module")
def server(engine: InferenceEngine) -> Iterator[InProcessServer]:
    with engine_server(engine, ServerConfig(max_request_bytes=64 * 1024)) as srv:
        yield srv


def test_chat_completion_shape_and_usage(oai: openai.OpenAI, engine: InferenceEngine) -> None:
    resp = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens == len(engine.tokenizer.encode_chat(CHAT))
    assert resp.usage.completion_tokens <= 16
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert choice.message.content == engine.generate_with_request(
        GenerateRequest(messages=CHAT, max_tokens=16, temperature=0)
    )


def test_chat_stream_chunks(oai: openai.OpenAI) -> None:
    whole = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    chunks = list(
        oai.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content


def test_chat_logprobs(oai: openai.OpenAI) -> None:
    resp = oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)


def test_completions_prompt_forms_and_n(oai: openai.OpenAI, engine: InferenceEngine) -> None:
    text = oai.completions.create(model=MODEL, prompt="The ocean is", max_tokens=8, temperature=0)
    assert text.object == "text_completion" and len(text.choices) == 1
    ids = engine.tokenizer.encode("The ocean is")
    by_ids = oai.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == text.choices[0].text
    several = oai.completions.create(model=MODEL, prompt=["The ocean is", "Mountains are"], max_tokens=8, temperature=0, n=2)
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert several.choices[0].text == several.choices[1].text == text.choices[0].text
    assert several.usage.prompt_tokens == len(ids) + len(engine.tokenizer.encode("Mountains are"))
    streamed = oai.completions.create(model=MODEL, prompt="The ocean is", max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text


def test_messages_shape_usage_and_stop_sequence(claude: anthropic.Anthropic, engine: InferenceEngine) -> None:
    msg = claude.messages.create(model=MODEL, max_tokens=16, system="Be brief.", messages=CHAT, extra_body={"temperature": 0})
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "text"
    prompt = engine.tokenizer.encode_chat([{"role": "system", "content": "Be brief."}, *CHAT])
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == len(prompt)
    assert msg.usage.output_tokens <= 16
    words = msg.content[0].text.split()
    assert len(words) >= 3, msg.content[0].text
    stop = words[2]
    cut = claude.messages.create(
        model=MODEL, max_tokens=16, system="Be brief.", messages=CHAT, stop_sequences=[stop], extra_body={"temperature": 0}
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == msg.content[0].text[: msg.content[0].text.index(stop)]
    count = claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=CHAT)
    assert count.input_tokens == len(prompt)


def test_messages_stream_events(claude: anthropic.Anthropic) -> None:
    whole = claude.messages.create(model=MODEL, max_tokens=12, messages=CHAT, extra_body={"temperature": 0})
    with claude.messages.stream(model=MODEL, max_tokens=12, messages=CHAT, extra_body={"temperature": 0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason == ("max_tokens" if whole.usage.output_tokens == 12 else "end_turn")


def test_messages_accept_sampling_fields_as_plain_fields(server: InProcessServer) -> None:
    body = {"model": MODEL, "max_tokens": 8, "messages": CHAT, "temperature": 0.5, "top_p": 0.9, "top_k": 20}
    resp = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60)
    assert resp.status_code == 200 and resp.json()["type"] == "message"


OPENAI_ERRORS = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", b"\xff\xfe{}", 400, None),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages.0.content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x " * 3000}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**8]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
]


@pytest.mark.parametrize("path,body,status,param", OPENAI_ERRORS)
def test_openai_errors_have_openai_shape(server: InProcessServer, path: str, body, status: int, param: str | None) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error


ANTHROPIC_ERRORS = [
    (b"{not json", 400, "invalid_request_error"),
    ({"model": MODEL, "messages": CHAT}, 400, "invalid_request_error"),  # max_tokens is required
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400, "invalid_request_error"),
    ({"model": "claude-9", "max_tokens": 5, "messages": CHAT}, 404, "not_found_error"),
    ({"model": MODEL, "max_tokens": 10**6, "messages": CHAT}, 400, "invalid_request_error"),
]


@pytest.mark.parametrize("body,status,kind", ANTHROPIC_ERRORS)
def test_anthropic_errors_have_anthropic_shape(server: InProcessServer, body, status: int, kind: str) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(f"{server.url}/v1/messages", content=content, headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == status, resp.text
    data = resp.json()
    assert data["type"] == "error" and data["error"]["type"] == kind and data["error"]["message"]


def test_sdks_raise_their_own_errors(oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    with pytest.raises(openai.NotFoundError) as unknown:
        oai.chat.completions.create(model="nope", messages=CHAT, max_tokens=4)
    assert unknown.value.status_code == 404 and unknown.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="nope", input="Hi", max_output_tokens=4)
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="nope", max_tokens=4, messages=CHAT)
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(model=MODEL + ":no-adapters-here", messages=CHAT, max_tokens=4)
    assert bad.value.body["param"] == "model" and "serves no adapters" in bad.value.body["message"]


def test_body_over_the_limit_is_413_in_both_shapes(server: InProcessServer) -> None:
    big = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 70_000}]}
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=big, timeout=30)
    assert resp.status_code == 413 and "max_request_bytes" in resp.json()["error"]["message"]
    resp = httpx.post(f"{server.url}/v1/messages", json=big, timeout=30)
    assert resp.status_code == 413 and resp.json()["error"]["type"] == "request_too_large"


def test_models_and_health(server: InProcessServer, engine: InferenceEngine) -> None:
    models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == engine.max_model_len
    assert httpx.get(f"{server.url}/v1/models/{MODEL}", timeout=10).json() == models["data"][0]
    missing = httpx.get(f"{server.url}/v1/models/other", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok", "model_loaded": True}


def test_not_ready_engine_answers_503(engine: InferenceEngine) -> None:
    with engine_server(engine, client=NotReadyClient) as srv:
        for path, body, check in [
            ("/v1/chat/completions", {"model": MODEL, "messages": CHAT}, lambda d: d["error"]["message"]),
            ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": CHAT}, lambda d: d["error"]["type"]),
        ]:
            resp = httpx.post(f"{srv.url}{path}", json=body, timeout=10)
            assert resp.status_code == 503 and check(resp.json())
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 503


def test_stats_and_metrics_count_a_request(server: InProcessServer, oai: openai.OpenAI, engine: InferenceEngine) -> None:
    """vLLM's metric names in the `serve_app:` namespace, each labelled with the model and the replica, move by
    what one request amounts to."""
    stats_before, before = httpx.get(f"{server.url}/stats", timeout=10).json(), metric_samples(server.url)
    reply = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    stats = httpx.get(f"{server.url}/stats", timeout=10).json()
    assert stats["total_tasks"] - stats_before["total_tasks"] == 1
    assert stats["total_tokens"] - stats_before["total_tokens"] == 4
    assert stats["active_tasks"] == 0 and stats["kv_pages_total"] == engine.get_stats()["kv_pages_total"]
    after = metric_samples(server.url)

    def grew(name: str, **labels: str) -> float:
        return after.total(f"serve_app:{name}", **labels) - before.total(f"serve_app:{name}", **labels)

    assert grew("request_success_total", finished_reason="length") == 1
    assert grew("request_success_total") == 1
    assert grew("prompt_tokens_total") == reply.usage.prompt_tokens
    assert grew("generation_tokens_total") == 4
    for histogram in (
        "time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
        "request_prompt_tokens", "request_generation_tokens",
    ):
        assert grew(f"{histogram}_count") == 1, histogram
    assert grew("request_prompt_tokens_sum") == reply.usage.prompt_tokens
    assert grew("request_generation_tokens_sum") == 4  # observed once, into the buckets from 5 tokens up
    assert grew("request_generation_tokens_bucket", le="5.0") == 1 and grew("request_generation_tokens_bucket", le="2.0") == 0
    assert 1 <= grew("inter_token_latency_seconds_count") <= 3  # a merged delta's tokens share one gap
    assert 0 <= grew("request_queue_time_seconds_sum") < grew("time_to_first_token_seconds_sum")
    assert grew("time_to_first_token_seconds_sum") < grew("e2e_request_latency_seconds_sum")
    assert grew("engine_requests_total") == 1
    assert grew("prefix_cache_queries_total") == reply.usage.prompt_tokens
    hits = stats["prefix_cache_hit_tokens"] - stats_before["prefix_cache_hit_tokens"]
    assert grew("prefix_cache_hits_total") == hits == reply.usage.prompt_tokens_details.cached_tokens
    assert grew("prefix_cache_tier_hits_total", tier="pool") == hits
    assert after.total("serve_app:prefix_cache_tier_hits_total", tier="host") == 0  # this engine has no tiers
    assert after.total("serve_app:num_requests_running") == 0 and after.total("serve_app:num_requests_waiting") == 0
    used = 1 - stats["kv_pages_free"] / stats["kv_pages_total"]
    assert after.total("serve_app:kv_cache_usage_perc") == pytest.approx(used)
    ours = [name for name in after.names() if name.startswith("serve_app:")]
    assert len(ours) >= 20
    for name in ours:
        for labels in after.labels(name):
            assert labels["model_name"] == MODEL and labels["replica"] == "in-process", (name, labels)


def test_disconnect_mid_stream_cancels_and_frees(server: InProcessServer, engine: InferenceEngine) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 1000, "stream": True, "ignore_eos": True}
    tokens_before = engine.get_stats()["total_tokens"]
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
    deadline = time.monotonic() + 15
    while engine.get_stats()["active_tasks"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = engine.get_stats()
    assert stats["active_tasks"] == 0
    assert stats["total_tokens"] - tokens_before < 1000


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_stream_options_without_stream_is_a_400_naming_it(server: InProcessServer, route: str) -> None:
    body = {"model": MODEL, "max_tokens": 2, "stream_options": {"include_usage": True}}
    body.update({"messages": CHAT} if route == "/v1/chat/completions" else {"prompt": "Hi"})
    resp = httpx.post(f"{server.url}{route}", json=body, timeout=30)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "stream_options" and "stream" in resp.json()["error"]["message"]
    body["stream"] = True
    with httpx.stream("POST", f"{server.url}{route}", json=body, timeout=30) as ok:
        assert ok.status_code == 200 and '"usage":{' in "".join(ok.iter_lines())
