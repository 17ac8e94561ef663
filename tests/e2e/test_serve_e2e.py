"""End to end through a real `serve run serve_config.yaml` on loopback, with the official SDKs."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import psutil
import pydantic
import pytest
import torch

from deployments.engine import HEARTBEAT_S
from serve_app import GenerateRequest, InferenceEngine
from serve_app.bench.client import CompletionClient
from serve_app.bench.idle import http_stats, wait_idle
from serve_app.bench.servers import ServeRun
from serve_app.kvsdk import connect, create_request, make_post_completion
from tests.agent_runs import weather_agent_answer
from tests.inprocess import anthropic_client, openai_client
from tests.served import (
    check_routing_across_an_idle_spell, metric_samples, ray_metric_samples, settled_metric_samples,
)

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def oai(served: ServeRun) -> openai.OpenAI:
    return openai_client(served.url)


@pytest.fixture(scope="module")
def claude(served: ServeRun) -> anthropic.Anthropic:
    return anthropic_client(served.url)


def _stats(served: ServeRun) -> dict:
    return http_stats(served.url)()


def _wait_idle(served: ServeRun) -> dict:
    return wait_idle(http_stats(served.url), timeout=20)


def test_health_models_and_config(served: ServeRun) -> None:
    assert httpx.get(f"{served.url}/health", timeout=10).json() == {"status": "ok", "model_loaded": True}
    card = httpx.get(f"{served.url}/v1/models", timeout=10).json()["data"][0]
    assert card["id"] == MODEL and card["max_model_len"] == 2048
    stats = _stats(served)
    assert stats["kv_pages_total"] == 8192 // 16
    assert stats["compiled_forward"] == 1  # compiled by default (the greedy test below holds it to eager)


def test_the_cards_command_answers_its_first_request_then_twenty_streams(served: ServeRun, oai: openai.OpenAI) -> None:
    """`serve run serve_config.yaml` as a user runs it: no RAY_SERVE_* settings, no RAY_ADDRESS."""
    environment = psutil.Process(served.process.pid).environ()
    assert not [key for key in environment if key.startswith(("RAY_SERVE_", "RAY_ADDRESS", "SERVE_APP_"))]
    first = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=8, timeout=60
    )
    assert first.choices[0].finish_reason in ("stop", "length") and first.usage.completion_tokens > 0

    def stream(index: int) -> tuple[str | None, int]:
        chunks = oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Tell me about river number {index}."}],
            max_tokens=12, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            timeout=120,
        )
        finish, tokens = None, 0
        for chunk in chunks:
            tokens = chunk.usage.completion_tokens if chunk.usage else tokens
            finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
        return finish, tokens

    with ThreadPoolExecutor(20) as pool:
        assert list(pool.map(stream, range(20))) == [("length", 12)] * 20


def test_routing_in_serves_default_mode_and_after_the_router_idled(served: ServeRun) -> None:
    check_routing_across_an_idle_spell(served.url)


def test_metrics_name_the_model_and_each_replica_and_reach_rays_metrics(served: ServeRun, oai: openai.OpenAI) -> None:
    """The ingress's /metrics labels its request metrics with its own replica and the engines' state with each
    engine replica; Ray's metrics agents export the same numbers (`ray_serve_app_*`) once Ray has pushed them."""
    _wait_idle(served)
    before = settled_metric_samples(served.url, "serve_app:prefix_cache_queries_total", HEARTBEAT_S)
    reply = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )
    engines = set(httpx.get(f"{served.url}/stats/replicas", timeout=10).json())
    _wait_idle(served)
    deadline = time.monotonic() + 30  # the board hears of the engine's counts within a heartbeat
    while True:
        after = metric_samples(served.url)
        queried = after.total("serve_app:prefix_cache_queries_total") - before.total("serve_app:prefix_cache_queries_total")
        if queried >= reply.usage.prompt_tokens or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert queried == reply.usage.prompt_tokens
    assert after.total("serve_app:request_success_total", finished_reason="length") - before.total(
        "serve_app:request_success_total", finished_reason="length") == 1
    assert after.total("serve_app:generation_tokens_total") - before.total("serve_app:generation_tokens_total") == 5
    assert after.total("serve_app:request_queue_time_seconds_count") > before.total("serve_app:request_queue_time_seconds_count")
    ingress = {labels["replica"] for labels in after.labels("serve_app:e2e_request_latency_seconds_count")}
    assert len(ingress) == 1 and not ingress & engines
    assert {labels["replica"] for labels in after.labels("serve_app:kv_cache_usage_perc")} == engines
    for name in after.names():
        for labels in after.labels(name):
            assert not name.startswith("serve_app:") or labels["model_name"] == MODEL, (name, labels)
    # One counter, gauge and histogram through Ray's metrics: the same counts as /metrics.
    wanted = {
        "ray_serve_app_request_success_total": after.total("serve_app:request_success_total"),
        "ray_serve_app_prefix_cache_queries_total": after.total("serve_app:prefix_cache_queries_total"),
        "ray_serve_app_e2e_request_latency_seconds_count": after.total("serve_app:e2e_request_latency_seconds_count"),
        "ray_serve_app_num_requests_running": 0,
    }
    deadline = time.monotonic() + 90
    while True:
        exported = ray_metric_samples(served.ray_dir)
        seen = {name: exported.total(name, model_name=MODEL) for name in wanted if exported.labels(name)}
        if seen == wanted or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert seen == wanted
    assert {labels["replica"] for labels in exported.labels("ray_serve_app_num_requests_running")} == engines


def test_chat_multi_turn_with_system_prompt(oai: openai.OpenAI, engine: InferenceEngine) -> None:
    messages = [
        {"role": "system", "content": "You are a geography teacher."},
        {"role": "user", "content": "What is the capital of Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "user", "content": [{"type": "text", "text": "And of Spain?"}]},
    ]
    resp = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    flat = [{**m, "content": m["content"] if isinstance(m["content"], str) else "And of Spain?"} for m in messages]
    expected = engine.generate_with_request(GenerateRequest(messages=flat, max_tokens=24, temperature=0))
    assert resp.choices[0].message.content == expected
    assert resp.usage.prompt_tokens == len(engine.tokenizer.encode_chat(flat))


def test_greedy_http_equals_in_process_engine_and_streams_match(oai: openai.OpenAI, engine: InferenceEngine) -> None:
    prompt = "Write two sentences about the moon."
    expected = engine.generate(prompt, max_tokens=32, temperature=0)
    done = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0)
    assert done.choices[0].text == expected
    stream = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=32, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    local = engine.submit(
        GenerateRequest(messages=[{"role": "user", "content": prompt}], max_tokens=32, temperature=0)
    ).wait(60)
    assert text == local.text
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == local.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == local.usage.prompt_tokens


def test_embeddings_through_serve_run_equal_the_in_process_engines(oai: openai.OpenAI, engine: InferenceEngine) -> None:
    texts = ["The moon orbits the earth.", "Paris is in France."]
    served = oai.embeddings.create(model=MODEL, input=texts)
    for data, text in zip(served.data, texts):
        local = engine.submit(GenerateRequest(prompt=text, embed=True)).wait(60).embedding
        assert max(abs(a - b) for a, b in zip(data.embedding, local)) < 1e-5


def test_stop_sequences_and_n(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Count from one to ten in words."}]
    full = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0).choices[0].message.content
    words = full.split()
    stop = words[len(words) // 2]
    cut = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    two = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=1.0, n=2, seed=5, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in two.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in two.choices)
    assert two.usage.completion_tokens == 24
    assert two.choices[0].message.content != two.choices[1].message.content


def test_seeded_sampling_is_reproducible_over_http(oai: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="A poem about rain:", max_tokens=24, temperature=1.0, seed=77)
    first = oai.completions.create(**kwargs).choices[0].text
    assert oai.completions.create(**kwargs).choices[0].text == first
    others = {oai.completions.create(**{**kwargs, "seed": s}).choices[0].text for s in (1, 2, 3)}
    assert others != {first}


def test_anthropic_messages_stream_and_stop(claude: anthropic.Anthropic, engine: InferenceEngine) -> None:
    messages = [{"role": "user", "content": "List four animals."}]
    msg = claude.messages.create(model=MODEL, max_tokens=24, system="Answer briefly.", messages=messages, extra_body={"temperature": 0})
    expected = engine.generate_with_request(
        GenerateRequest(messages=[{"role": "system", "content": "Answer briefly."}, *messages], max_tokens=24, temperature=0)
    )
    assert msg.content[0].text == expected
    with claude.messages.stream(
        model=MODEL, max_tokens=24, system="Answer briefly.", messages=messages, extra_body={"temperature": 0}
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == expected and final.stop_reason == msg.stop_reason
    stop = expected.split()[1]
    cut = claude.messages.create(
        model=MODEL, max_tokens=24, system="Answer briefly.", messages=messages, stop_sequences=[stop],
        extra_body={"temperature": 0},
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop


def test_errors_keep_their_shapes_and_the_server_keeps_serving(served: ServeRun, oai: openai.OpenAI) -> None:
    bad_json = httpx.post(f"{served.url}/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"
    too_long = httpx.post(f"{served.url}/v1/completions", json={"model": MODEL, "prompt": "word " * 3000}, timeout=30)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt"
    over = httpx.post(
        f"{served.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000},
        timeout=30,
    )
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
    unknown = httpx.post(f"{served.url}/v1/messages", json={"model": "x", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    huge = httpx.post(f"{served.url}/v1/completions", json={"model": MODEL, "prompt": "x" * (5 * 1024 * 1024)}, timeout=60)
    assert huge.status_code == 413 and huge.json()["error"]["type"] == "invalid_request_error"
    assert oai.completions.create(model=MODEL, prompt="Still alive?", max_tokens=4, temperature=0).choices[0].text


def test_disconnect_mid_stream_frees_the_pages(served: ServeRun) -> None:
    idle = _wait_idle(served)
    total = idle["kv_pages_total"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        for _ in range(8):
            next(lines)
        deadline = time.monotonic() + 10  # the stats board hears from the replica within a second
        while not (busy := _stats(served))["active_tasks"] and time.monotonic() < deadline:
            time.sleep(0.1)
    assert busy["active_tasks"] == 1 and busy["kv_pages_free"] < total
    stats = _wait_idle(served)
    assert stats["active_tasks"] == 0 and stats["kv_pages_free"] == total
    assert stats["total_tokens"] - idle["total_tokens"] < 1500


def test_sixteen_concurrent_streaming_clients(oai: openai.OpenAI, engine: InferenceEngine, served: ServeRun) -> None:
    prompts = [f"Give me fact number {i} about the sea." for i in range(16)]
    expected = engine.generate([p for p in prompts], max_tokens=24, temperature=0)

    def stream(prompt: str) -> str:
        chunks = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in chunks)

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(stream, prompts))
    assert texts == expected
    stats = _wait_idle(served)
    assert stats["active_tasks"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]


def test_kv_sdk_through_serve(served: ServeRun, engine: InferenceEngine) -> None:
    """Retrieve, store under another salt and decode from the stored KV, through the Ray handles."""
    context = connect(served.url)
    assert context.config == engine.kv.config()
    post = make_post_completion(served.url)
    prompt = engine.tokenizer.encode("The lighthouse keeper climbed the stairs. " * 8)
    greedy = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    original = create_request(context, post, prompt, cache_salt="e2e-a")
    original.generate(greedy)
    kv = original.retrieve()
    engine.submit(GenerateRequest(prompt=prompt, max_tokens=1, client_salt="e2e-ref")).wait(60)
    reference = engine.kv.retrieve(prompt, "e2e-ref")
    assert reference is not None
    # The replica's forward is compiled (fused kernels sum in another order), the reference eager: the
    # tolerance of tests/engine/test_compiled.py between the two.
    torch.testing.assert_close(kv[:, :, : reference.shape[2]], reference, atol=1e-4, rtol=1e-4)
    stored = kv.shape[2]
    assert context.store(kv, original.tokens[:stored], "e2e-b") is True
    assert context.store(kv, original.tokens[:stored], "e2e-b") is False
    before = _wait_idle(served)
    copy = create_request(context, post, prompt, cache_salt="e2e-b")
    copy.generate(greedy)
    assert copy.decoded_tokens == original.decoded_tokens
    deadline = time.monotonic() + 10  # the stats board hears from the replica within a second
    after = _stats(served)
    while after["total_tasks"] == before["total_tasks"] and time.monotonic() < deadline:
        time.sleep(0.1)
        after = _stats(served)
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == (len(prompt) - 1) // 16 * 16


class Fruit(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    sweet: bool


class LooseFruit(pydantic.BaseModel):
    """Anthropic's SDK moves length limits into descriptions (its API takes none), so none here."""

    name: str
    sweet: bool


def test_structured_output_through_serve(oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    """The grammar is compiled and enforced in the engine replica's own process."""
    reply = oai.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], response_format=Fruit, max_tokens=60,
        temperature=0,
    )
    assert isinstance(reply.choices[0].message.parsed, Fruit)
    parsed = claude.messages.parse(
        model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "Name a fruit."}], output_format=LooseFruit,
        extra_body={"temperature": 0},
    )
    assert isinstance(parsed.parsed_output, LooseFruit)
    bad = httpx.post(
        f"{oai.base_url}chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
              "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
        timeout=60,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format.json_schema.schema"


def test_a_required_tool_call_through_serve(oai: openai.OpenAI) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]},
        },
    }
    reply = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[tool], tool_choice="required",
        parallel_tool_calls=False, max_tokens=60, temperature=0,
    )
    call = reply.choices[0].message.tool_calls[0]
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)


def test_streamed_tool_calls_and_a_tool_loop_through_serve(oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    """Both SDKs' stream helpers assemble the calls the engine replica's grammar forced; results go back in."""
    parameters = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}
    tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": parameters}}
    ask = [{"role": "user", "content": "Weather in Rome?"}]
    with oai.chat.completions.stream(
        model=MODEL, messages=ask, tools=[tool], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60, temperature=0,
    ) as stream:
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert final.choices[0].finish_reason == "tool_calls" and isinstance(json.loads(call.function.arguments)["city"], str)
    history = [*ask, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"}]
    answer = oai.chat.completions.create(model=MODEL, messages=history, tools=[tool], tool_choice="none", max_tokens=12,
                                         temperature=0)
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
    claude_tool = {"name": "get_weather", "description": "The weather.", "input_schema": parameters}
    with claude.messages.stream(model=MODEL, max_tokens=60, messages=ask, tools=[claude_tool], tool_choice={"type": "any"},
                                extra_body={"temperature": 0}) as stream:
        message = stream.get_final_message()
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and uses and isinstance(uses[0].input["city"], str)


def test_the_responses_api_through_serve(served: ServeRun, oai: openai.OpenAI) -> None:
    """Streamed events, a stored response continued from the prefix cache (the store is a deployment every
    ingress replica shares), and the OpenAI Agents SDK's default model class running a function tool."""
    events = list(oai.responses.create(model=MODEL, input="My name is Ada and I keep bees above the harbour.",
                                       max_output_tokens=12, temperature=0, stream=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    first = events[-1].response
    assert first.output_text and oai.responses.retrieve(first.id).output_text == first.output_text
    second = oai.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name?",
                                  max_output_tokens=8, temperature=0)
    assert second.usage.input_tokens_details.cached_tokens >= 16

    weather = weather_agent_answer(served.url)
    assert isinstance(weather, str) and weather.startswith("18 degrees and sunny in ")


def test_a_batch_api_batch_answers_as_the_online_route_does(oai: openai.OpenAI) -> None:
    """The OpenAI SDK's batch round trip on the card's command: each greedy answer is the online route's."""
    questions = ["What is the capital of France?", "Name a primary colour.", "Say hello."]
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": [{"role": "user", "content": q}], "max_tokens": 12, "temperature": 0}}
             for i, q in enumerate(questions)]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    file_id = oai.files.create(file=("questions.jsonl", text.encode()), purpose="batch").id
    batch = oai.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while (batch := oai.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.25)
    assert batch.status == "completed" and batch.request_counts.completed == 3
    answers = {line["custom_id"]: line["response"]["body"]["choices"][0]["message"]["content"]
               for line in map(json.loads, oai.files.content(batch.output_file_id).text.splitlines())}
    for i, question in enumerate(questions):
        online = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                             max_tokens=12, temperature=0)
        assert answers[f"q{i}"] == online.choices[0].message.content


def test_the_benchmark_clients_count_a_streamed_chat_and_completion_alike(served: ServeRun) -> None:
    """`bench compare`'s two workloads: a chat's tokens come from its usage, a completion's from its token ids."""

    async def one(api: str, prompt: list) -> tuple:
        async with CompletionClient(served.url, api=api) as client:
            return await client.stream(MODEL, prompt, 9)

    chat = asyncio.run(one("chat", [{"role": "user", "content": "Tell me about the rules of chess."}]))
    completion = asyncio.run(one("openai", [504, 3458, 281]))
    for timing in (chat, completion):
        assert timing.output_tokens == 9 and len(timing.gaps) == 8 and timing.ttft > 0
    assert chat.chunk_gaps and all(gap >= 0 for gap in chat.chunk_gaps)
