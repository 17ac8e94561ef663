"""Structured output: a grammar (xgrammar) masks each step's logits, so outputs match their constraint.

In the engine over many schemas and prompts (fixed and generated, greedy and sampled), mixed
with unconstrained requests, with seeds, stop strings, `max_tokens`, logprobs, prefix hits,
cancellation and preemption; then through the OpenAI and Anthropic SDKs in process.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pydantic
import pytest

from serve_app import GenerateRequest, InferenceEngine, StreamDelta
from serve_app.bench.idle import wait_idle
from serve_app.wire.refusals import InvalidRequestError
from serve_app.wire.requests import StructuredOutput
from tests.inprocess import MODEL, InProcessServer
from tests.references import ReferenceModel

SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
        "required": ["colour", "bright"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "location": {
                "type": "object",
                "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                "required": ["lat", "lon"],
            },
        },
        "required": ["city", "location"],
    },
    {"type": "object", "properties": {"answer": {"type": "string", "pattern": "^[a-z]{1,10}$"}}, "required": ["answer"]},
]
PROMPTS = [
    "Describe a person as JSON.",
    "Pick a colour and say whether it is bright.",
    "List some fruits.",
    "Where is Paris?",
    "Answer in one lowercase word: what do cows drink?",
]


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _schema_request(schema: dict, prompt: str, **sampling) -> GenerateRequest:
    return GenerateRequest(
        messages=_chat(prompt), max_tokens=120, structured_output=StructuredOutput(json=schema), **sampling
    )


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=11)], ids=["greedy", "sampled"])
def test_outputs_validate_against_their_schemas(engine: InferenceEngine, sampling: dict) -> None:
    results = [
        (schema, engine.submit(_schema_request(schema, prompt, **sampling)))
        for schema in SCHEMAS
        for prompt in PROMPTS
    ]
    for schema, stream in results:
        result = stream.wait(300)
        assert result.finish_reason == "stop", (schema, result.text)
        jsonschema.validate(json.loads(result.text), schema)


def _random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema of the kinds clients send: objects of typed, bounded fields, arrays, enums, nesting."""
    leaves = [
        lambda: {"type": "string", "maxLength": rng.randint(1, 16)},
        lambda: {"type": "integer", "minimum": rng.randint(-50, 0), "maximum": rng.randint(1, 500)},
        lambda: {"type": "number"},
        lambda: {"type": "boolean"},
        lambda: {"enum": rng.sample(["red", "green", "blue", "north", "south", 7, True, None], rng.randint(1, 4))},
        lambda: {"type": "string", "pattern": "^[a-z]{1,8}$"},
        lambda: {"type": ["string", "null"], "maxLength": 10},
    ]
    kinds = leaves + ([] if depth >= 1 else [lambda: _random_schema(rng, depth + 1)] * 2)
    if depth > 0 and rng.random() < 0.3:
        return {"type": "array", "items": rng.choice(leaves)(), "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    names = rng.sample(["id", "name", "size", "ok", "tags", "where", "kind", "score", "note"], rng.randint(1, 4))
    properties = {name: rng.choice(kinds)() for name in names}
    required = [name for name in names if rng.random() < 0.7]
    schema = {"type": "object", "properties": properties, "required": required}
    if rng.random() < 0.5:
        schema["additionalProperties"] = False
    return schema


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, seed=3)], ids=["greedy", "sampled"])
def test_outputs_validate_against_generated_schemas(engine: InferenceEngine, sampling: dict) -> None:
    rng = random.Random(2026)
    schemas = [_random_schema(rng) for _ in range(24)]
    results = [
        engine.submit(GenerateRequest(messages=_chat(PROMPTS[i % len(PROMPTS)]), max_tokens=300,
                                      structured_output=StructuredOutput(json=schema), **sampling))
        for i, schema in enumerate(schemas)
    ]
    for schema, stream in zip(schemas, results):
        result = stream.wait(300)
        assert result.finish_reason == "stop", (schema, result.text)
        jsonschema.validate(json.loads(result.text), schema)


def test_constrained_requests_keep_seeds_stops_limits_logprobs_prefix_hits_and_cancellation(engine: InferenceEngine) -> None:
    schema, prompt = SCHEMAS[3], "Where is Rome? " + "Answer as JSON. " * 10
    whole = engine.submit(_schema_request(schema, prompt, temperature=0.8, seed=21, logprobs=2)).wait(120)
    assert whole.finish_reason == "stop" and len(whole.logprobs) == len(whole.token_ids)
    assert all(math.isfinite(lp.logprob) and len(lp.top) == 2 for lp in whole.logprobs)
    again = engine.submit(_schema_request(schema, prompt, temperature=0.8, seed=21)).wait(120)
    assert again.token_ids == whole.token_ids and again.cached_tokens >= 16  # the same seed; the prompt's pages reused
    cut = engine.submit(
        GenerateRequest(messages=_chat(prompt), max_tokens=5, temperature=0.8, seed=21, structured_output=StructuredOutput(json=schema))
    ).wait(120)
    assert cut.finish_reason == "length" and cut.token_ids == whole.token_ids[:5]
    stopped = engine.submit(
        GenerateRequest(messages=_chat(prompt), max_tokens=120, temperature=0.8, seed=21, stop=['"location"'],
                        structured_output=StructuredOutput(json=schema))
    ).wait(120)
    assert stopped.finish_reason == "stop" and stopped.stop_string == '"location"'
    assert whole.text.startswith(stopped.text) and '"location"' in whole.text
    seen: list[StreamDelta] = []
    running = engine.submit(
        _schema_request({"type": "array", "items": {"type": "integer"}}, "Count to a million.", temperature=0), seen.append
    )
    while not seen:
        time.sleep(0.02)
    assert running.task_id is not None
    engine.abort(running.task_id)
    assert running.wait(60).finish_reason == "cancelled"


def test_regex_and_choice_outputs_match(engine: InferenceEngine) -> None:
    pattern = r"[0-9]{3}-[A-Z]{2}"
    for seed in range(4):
        regex = GenerateRequest(
            messages=_chat("Make up a code."), max_tokens=20, temperature=1.0, seed=seed,
            structured_output=StructuredOutput(regex=pattern),
        )
        choice = GenerateRequest(
            messages=_chat("Is the sea wet?"), max_tokens=20, temperature=1.0, seed=seed,
            structured_output=StructuredOutput(choice=["yes", "no", "maybe"]),
        )
        assert re.fullmatch(pattern, engine.submit(regex).wait(60).text)
        assert engine.submit(choice).wait(60).text in ("yes", "no", "maybe")


def test_unconstrained_requests_in_a_constrained_batch_keep_their_greedy_tokens(
    engine: InferenceEngine, reference: ReferenceModel
) -> None:
    plain = [engine.tokenizer.encode_chat(_chat(p)) for p in PROMPTS[:3]]
    expected = [reference.greedy(ids, 16) for ids in plain]
    constrained = [engine.submit(_schema_request(SCHEMAS[0], p, temperature=0)) for p in PROMPTS]
    mixed = [engine.submit(GenerateRequest(prompt=ids, max_tokens=16, temperature=0, ignore_eos=True)) for ids in plain]
    assert [r.wait(120).token_ids for r in mixed] == expected
    alone = engine.submit(_schema_request(SCHEMAS[0], PROMPTS[0], temperature=0)).wait(120)
    assert constrained[0].wait(120).token_ids == alone.token_ids


def test_a_schema_that_cannot_be_enforced_is_refused_before_queueing(engine: InferenceEngine) -> None:
    before = engine.get_stats()["total_tasks"]
    bad = StructuredOutput(json={"type": "nonsense"}, param="response_format.json_schema.schema")
    with pytest.raises(InvalidRequestError) as refused:
        engine.submit(GenerateRequest(messages=_chat("Hi"), structured_output=bad))
    assert refused.value.param == "response_format.json_schema.schema" and "nonsense" in refused.value.message
    with pytest.raises(InvalidRequestError, match="Unclosed"):
        engine.submit(GenerateRequest(prompt="Hi", structured_output=StructuredOutput(regex="[abc")))
    assert engine.get_stats()["total_tasks"] == before
    assert engine.submit(_schema_request(SCHEMAS[1], PROMPTS[1], temperature=0)).wait(60).finish_reason == "stop"


def test_constrained_requests_survive_preemption(model_path: Path) -> None:
    eng = InferenceEngine(compile=False, model=str(model_path), page_size=16, cache_tokens=16 * 14, max_model_len=512)
    try:
        results = [eng.submit(_schema_request(SCHEMAS[3], f"Where is city number {i}?", temperature=0)) for i in range(6)]
        for stream in results:
            result = stream.wait(300)
            assert result.finish_reason == "stop"
            jsonschema.validate(json.loads(result.text), SCHEMAS[3])
        stats = wait_idle(eng.get_stats)
        assert stats["preemptions"] > 0
    finally:
        eng.shutdown()


# -- over HTTP, with the official SDKs ----------------------------------------------------------


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int


class LoosePerson(pydantic.BaseModel):
    """Anthropic's SDK moves length limits into descriptions (its API takes none), so none here."""

    name: str
    age: int


def test_openai_parse_returns_the_pydantic_object(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.parse(
        model=MODEL, messages=_chat("Describe a person."), response_format=Person, max_tokens=80, temperature=0
    )
    assert isinstance(reply.choices[0].message.parsed, Person)
    assert reply.choices[0].finish_reason == "stop"


def test_json_object_and_streamed_json_schema(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(
        model=MODEL, messages=_chat("Reply with a JSON object whose key ok is true."), max_tokens=200, temperature=0,
        response_format={"type": "json_object"},
    )
    assert reply.choices[0].finish_reason == "stop" and isinstance(json.loads(reply.choices[0].message.content), dict)
    stream = oai.chat.completions.create(
        model=MODEL, messages=_chat("Pick a colour."), max_tokens=80, temperature=0.7, seed=5, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "colour", "schema": SCHEMAS[1], "strict": True}},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMAS[1])


def test_vllm_structured_outputs_on_both_openai_routes(oai: openai.OpenAI) -> None:
    chosen = oai.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=8, temperature=1.0, seed=3, n=3,
        extra_body={"structured_outputs": {"choice": ["blue", "grey"]}},
    )
    assert {c.text for c in chosen.choices} <= {"blue", "grey"}
    code = oai.chat.completions.create(
        model=MODEL, messages=_chat("A code, please."), max_tokens=12,
        extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{2}"}},
    )
    assert re.fullmatch("[A-Z]{2}[0-9]{2}", code.choices[0].message.content)
    schema = oai.chat.completions.create(
        model=MODEL, messages=_chat("List fruits."), max_tokens=60, temperature=0,
        extra_body={"structured_outputs": {"json": json.dumps(SCHEMAS[2])}},
    )
    jsonschema.validate(json.loads(schema.choices[0].message.content), SCHEMAS[2])


@pytest.mark.parametrize(
    "body,param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
        ({"function_call": "auto"}, "function_call"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ],
)
def test_openai_refusals_name_the_field_and_the_server_keeps_serving(server: InProcessServer, body: dict, param: str) -> None:
    url = f"{server.url}/v1/chat/completions"
    resp = httpx.post(url, json={"model": MODEL, "messages": _chat("Hi"), "max_tokens": 4, **body}, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert httpx.post(url, json={"model": MODEL, "messages": _chat("Hi"), "max_tokens": 2}, timeout=60).status_code == 200


def test_anthropic_output_config_format_and_its_refusals(claude: anthropic.Anthropic, server: InProcessServer) -> None:
    parsed = claude.messages.parse(
        model=MODEL, max_tokens=100, messages=_chat("Describe a person."), output_format=LoosePerson,
        extra_body={"temperature": 0},
    )
    assert isinstance(parsed.parsed_output, LoosePerson) and parsed.stop_reason == "end_turn"
    url = f"{server.url}/v1/messages"
    base = {"model": MODEL, "max_tokens": 4, "messages": _chat("Hi")}
    bad = {**base, "output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}}
    resp = httpx.post(url, json=bad, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    assert "output_config.format.schema" in resp.json()["error"]["message"]
    thinking = httpx.post(url, json={**base, "thinking": {"type": "enabled", "budget_tokens": 1024}}, timeout=60)
    assert thinking.status_code == 400 and "thinking" in thinking.json()["error"]["message"]
    assert httpx.post(url, json=base, timeout=60).status_code == 200


# -- bounds beyond the grammar: one string's tokens, the constrained part's tokens -----------------------------

STORY = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}


def _story(engine: InferenceEngine, **limits: int) -> GenerateRequest:
    return GenerateRequest(
        messages=[{"role": "user", "content": "Describe Paris in detail."}], max_tokens=120,
        temperature=0, structured_output=StructuredOutput(json=STORY), **limits,
    )


def test_max_string_tokens_closes_a_long_string_and_the_answer_stays_whole(engine: InferenceEngine) -> None:
    runaway = engine.submit(_story(engine)).wait(120)
    assert runaway.finish_reason == "length"  # the packaged model keeps writing inside the string
    bounded = engine.submit(_story(engine, max_string_tokens=10)).wait(120)
    assert bounded.finish_reason == "stop", bounded.text
    story = json.loads(bounded.text)["story"]
    assert runaway.text.startswith(bounded.text[: bounded.text.index(story) + len(story)])  # the same words, closed
    assert len(bounded.token_ids) <= 20  # the key, 10 tokens of string, its close, the end


def test_max_constrained_tokens_ends_a_json_answer_as_cut(engine: InferenceEngine) -> None:
    result = engine.submit(_story(engine, max_constrained_tokens=16)).wait(120)
    assert result.finish_reason == "length" and len(result.token_ids) == 16


@pytest.mark.parametrize("field", ["max_string_tokens", "max_constrained_tokens"])
@pytest.mark.parametrize("constraint", [None, StructuredOutput(regex="[a-z]+")], ids=["none", "regex"])
def test_the_bounds_of_a_json_answer_need_one(engine: InferenceEngine, field: str, constraint) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        engine.submit(GenerateRequest(prompt="Hello", structured_output=constraint, **{field: 4}))
    assert refused.value.param == field


def test_xgrammar_enforces_max_length_and_max_items(engine: InferenceEngine) -> None:
    short = engine.grammars.matcher(StructuredOutput(json={"type": "string", "maxLength": 5}))
    assert short.accept_string('"abcde') and not short.accept_string("f") and short.accept_string('"')
    few = engine.grammars.matcher(StructuredOutput(json={"type": "array", "items": {"type": "integer"}, "maxItems": 2}))
    assert few.accept_string("[1, 2") and not few.accept_string(", ") and few.accept_string("]")


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 4}),
    ],
)
def test_max_string_tokens_without_a_json_answer_is_a_400_naming_it(server: InProcessServer, path: str, body: dict) -> None:
    resp = httpx.post(f"{server.url}{path}", json={"model": MODEL, "max_string_tokens": 8, **body}, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert "max_string_tokens" in error["message"] and error.get("param", "max_string_tokens") == "max_string_tokens"


def test_the_servers_bound_on_constrained_tokens_holds_when_the_request_sets_none(engine: InferenceEngine) -> None:
    from serve_app.config import ServerConfig
    from tests.inprocess import engine_server, openai_client

    with engine_server(engine, ServerConfig(max_constrained_tokens=16)) as bounded:
        client = openai_client(bounded.url)
        ask = dict(model=MODEL, messages=[{"role": "user", "content": "Describe Paris in detail."}],
                   response_format={"type": "json_schema", "json_schema": {"name": "story", "schema": STORY}}, temperature=0)
        unset = client.chat.completions.create(**ask)
        assert unset.choices[0].finish_reason == "length" and unset.usage.completion_tokens == 16
        asked = client.chat.completions.create(**ask, max_tokens=40)
        assert asked.usage.completion_tokens == 40  # a request's own limit wins
