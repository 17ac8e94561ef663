"""The OpenAI Responses API (`/v1/responses`) with the official SDK, in process: text, streamed events,
function tools, `text.format`, stored responses and `previous_response_id`, tenants, errors, and
the OpenAI Agents SDK's default model class."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
import yaml
from pydantic import BaseModel, Field

from serve_app import InferenceEngine
from serve_app.http.response_store import ResponseStore, StoredResponse
from serve_app.http.tenants import TenantDirectory, load_keys
from serve_app.http.tools.plan import Turn
from tests.agent_runs import weather_agent_answer
from tests.inprocess import MODEL, InProcessServer, engine_server

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}},
        "required": ["city"],
    },
}


class Capital(BaseModel):
    city: str = Field(max_length=30)
    country: str = Field(max_length=30)


def test_text_answers_as_chat_completions_do(oai: openai.OpenAI) -> None:
    response = oai.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=40, temperature=0)
    chat = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=40, temperature=0
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.incomplete_details is None
    assert response.output_text == chat.choices[0].message.content  # the same prompt, greedy
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    usage = response.usage
    assert usage.input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_instructions_are_the_system_message_and_max_output_tokens_cuts_short(oai: openai.OpenAI) -> None:
    response = oai.responses.create(
        model=MODEL, instructions="Answer in French.", input="Say good morning.", max_output_tokens=3, temperature=0,
        metadata={"run": "7"}, user="someone",
    )
    chat = oai.chat.completions.create(
        model=MODEL, max_tokens=3, temperature=0,
        messages=[{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Say good morning."}],
    )
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output_text == chat.choices[0].message.content
    assert response.metadata == {"run": "7"} and response.user == "someone" and response.instructions == "Answer in French."


def test_streamed_events_come_in_openais_order_and_assemble_the_text(oai: openai.OpenAI) -> None:
    events = list(oai.responses.create(model=MODEL, input="Tell me a short story.", max_output_tokens=24,
                                       temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1 and set(kinds[4:-4]) == {"response.output_text.delta"}
    final = events[-1].response
    assert "".join(deltas) == final.output_text == events[-4].text
    assert events[0].response.status == "in_progress" and final.status == "incomplete"
    assert final.usage.output_tokens == 24

    with oai.responses.stream(model=MODEL, input="Name a colour.", max_output_tokens=40, temperature=0) as stream:
        streamed = stream.get_final_response()
    assert streamed.output_text == oai.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=40,
                                                        temperature=0).output_text


def test_a_function_tool_round_trip(oai: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = oai.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice="required",
                                  max_output_tokens=120, temperature=0)
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and called.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    results = [{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}
               for call in calls]
    # The whole history sent back (the SDK's own output items), then the stored one continued.
    for follow_up in (
        dict(input=[*ask, *[item.model_dump(exclude_none=True) for item in called.output], *results]),
        dict(input=results, previous_response_id=called.id),
    ):
        answer = oai.responses.create(model=MODEL, tools=[WEATHER], tool_choice="none", max_output_tokens=40,
                                      temperature=0, **follow_up)
        assert answer.output[0].type == "message" and answer.output_text
        assert not [item for item in answer.output if item.type == "function_call"]
    named = oai.responses.create(model=MODEL, input=ask, tools=[WEATHER], max_output_tokens=120, temperature=0,
                                 tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False)
    assert [item.name for item in named.output if item.type == "function_call"] == ["get_weather"]


def test_a_streamed_function_call_has_its_argument_events(oai: openai.OpenAI) -> None:
    events = list(oai.responses.create(model=MODEL, input="What is the weather in Rome?", tools=[WEATHER],
                                       tool_choice="required", max_output_tokens=120, temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.arguments == ""
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.item_id == done.item_id]
    assert pieces == [done.arguments]  # the arguments stream once whole: a cut call never shows
    jsonschema.validate(json.loads(done.arguments), WEATHER["parameters"])
    [call] = [item for item in events[-1].response.output if item.type == "function_call"][:1]
    assert call.arguments == done.arguments and call.call_id.startswith("call_")
    assert (call.id, call.call_id) == (added.item.id, added.item.call_id)  # the response holds the streamed item


def test_text_format_holds_the_answer_to_a_schema(oai: openai.OpenAI) -> None:
    schema = Capital.model_json_schema()
    for temperature in (0, 1.0):
        response = oai.responses.create(
            model=MODEL, input="The capital of France, as JSON.", max_output_tokens=80, temperature=temperature,
            text={"format": {"type": "json_schema", "name": "capital", "schema": schema, "strict": True}},
        )
        jsonschema.validate(json.loads(response.output_text), schema)
        assert response.text.format.type == "json_schema"
    parsed = oai.responses.parse(model=MODEL, input="The capital of Italy.", text_format=Capital,
                                 max_output_tokens=80, temperature=0)
    assert isinstance(parsed.output_parsed, Capital)
    anything = oai.responses.create(model=MODEL, input="Give a person's name and age as JSON.", max_output_tokens=200,
                                    temperature=0, text={"format": {"type": "json_object"}})
    assert anything.status == "completed" and isinstance(json.loads(anything.output_text), dict)


def test_previous_response_id_continues_from_the_prefix_cache(oai: openai.OpenAI) -> None:
    first = oai.responses.create(model=MODEL, instructions="Be brief.", max_output_tokens=16, temperature=0,
                                 input="My name is Ada and I keep bees in the hills above the old harbour town.")
    second = oai.responses.create(model=MODEL, previous_response_id=first.id, input="What is my name?",
                                  max_output_tokens=16, temperature=0)
    assert second.previous_response_id == first.id
    # The conversation so far (without the first's instructions) came back, and from the cache.
    assert second.usage.input_tokens > first.usage.input_tokens - 10 + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16
    assert oai.responses.retrieve(first.id).output_text == first.output_text
    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as missing:
        oai.responses.create(model=MODEL, previous_response_id=first.id, input="Again?", max_output_tokens=4)
    assert missing.value.body["param"] == "previous_response_id"
    unstored = oai.responses.create(model=MODEL, input="Hello.", max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format.schema"),
        ({"frequency_bonus": 1}, "frequency_bonus"),
        ({"background": True}, "background"),
    ],
)
def test_what_is_not_supported_is_a_400_naming_it(server: InProcessServer, extra: dict, param: str) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, **extra}
    reply = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"].startswith(param), error
    assert httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2},
                      timeout=60).status_code == 200


def test_a_tenant_never_sees_another_tenants_stored_responses(engine: InferenceEngine, tmp_path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"key-a": {"tenant": "acme"}, "key-b": {"tenant": "globex"}}))
    with engine_server(engine, tenants=TenantDirectory(load_keys(keys), "s")) as srv:
        acme, globex = (openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0) for key in ("key-a", "key-b"))
        mine = acme.responses.create(model=MODEL, input="Hello.", max_output_tokens=4)
        assert acme.responses.retrieve(mine.id).id == mine.id
        with pytest.raises(openai.NotFoundError):
            globex.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            globex.responses.create(model=MODEL, previous_response_id=mine.id, input="And?", max_output_tokens=4)
        with pytest.raises(openai.NotFoundError):
            globex.responses.delete(mine.id)
        assert acme.responses.retrieve(mine.id).id == mine.id


def test_a_response_the_store_cannot_keep_fails_in_the_protocols_shape(
    server: InProcessServer, oai: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def store_gone(tenant: str, stored: StoredResponse) -> None:
        raise ConnectionError("the response store is unreachable")

    monkeypatch.setattr(server.context.responses, "put", store_gone)
    with pytest.raises(openai.InternalServerError):
        oai.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    events = list(oai.responses.create(model=MODEL, input="Hi", max_output_tokens=3, stream=True))
    assert events[-1].type == "response.failed", [e.type for e in events]
    assert events[-1].response.status == "failed" and "could not be kept" in events[-1].response.error.message
    assert "response.completed" not in [e.type for e in events]
    calling = list(oai.responses.create(model=MODEL, input="Weather in Rome?", tools=[WEATHER], tool_choice="required",
                                        max_output_tokens=60, temperature=0, stream=True))
    assert "response.function_call_arguments.done" in [e.type for e in calling]  # the call streamed whole, then:
    assert calling[-1].type == "response.failed" and "could not be kept" in calling[-1].response.error.message
    monkeypatch.undo()  # the server keeps serving, and stores again
    kept = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    assert oai.responses.retrieve(kept.id).id == kept.id


def test_the_store_is_bounded_by_count_and_age_per_tenant() -> None:
    def stored(response_id: str) -> StoredResponse:
        return StoredResponse({"id": response_id}, (Turn("user", "hi"),))

    store = ResponseStore(max_per_tenant=2, max_age_s=0.2)
    for index in range(3):
        store.put("a", stored(f"resp_{index}"))
    store.put("b", stored("resp_b"))
    assert store.get("a", "resp_0") is None and store.get("a", "resp_2") is not None  # the oldest went first
    assert store.get("b", "resp_2") is None and store.get("b", "resp_b") is not None
    time.sleep(0.3)
    assert store.get("a", "resp_2") is None and store.get("b", "resp_b") is None  # too old


def test_the_agents_sdk_default_model_runs_an_agent_with_a_function_tool(server: InProcessServer) -> None:
    weather = weather_agent_answer(server.url)
    assert isinstance(weather, str) and weather.startswith("18 degrees and sunny in ")  # the tool ran on the model's call
