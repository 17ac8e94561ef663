"""Tool-mode answers stay well-formed whatever the small model does, in all three APIs, streamed and not:
a call cut by the token limit is dropped while the whole calls before it stay (with the API's length
reason), the generic format's JSON wrapper never reaches the client's text, a call repeating an earlier
one ends the answer, calls under `auto` hold to their schemas, and `tools` with a response format give
either calls or an answer in that format (through the OpenAI Agents SDK too)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import anthropic
import httpx
import openai
import pydantic
import pytest

from serve_app.engine.engine import InferenceEngine
from serve_app.http.protocols.anthropic import MessagesBuilder
from serve_app.http.protocols.openai import ChatCompletionsBuilder
from serve_app.http.protocols.responses import ResponsesBuilder
from serve_app.wire.model_card import ModelInfo
from serve_app.wire.requests import GenerateRequest
from tests.inprocess import MODEL, InProcessServer

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
DESCRIPTION = "The current weather in a city."  # with it, the packaged model calls get_weather twice alike
QUESTION = "What is the weather in Paris?"
WIRE = ("tool_calls", '"response"', '{"name"', '"arguments"')  # the generic format's wrapper


@dataclass(frozen=True)
class Answer:
    """An answer as the client saw it: its calls, its text, and how it ended (`whole` or `cut`)."""

    calls: list[tuple[str, dict]]
    text: str
    ended: str


def _chat(oai: openai.OpenAI, max_tokens: int, stream: bool) -> Answer:
    tools = [{"type": "function", "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": PARAMETERS}}]
    asked = dict(model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=tools, tool_choice="required",
                 max_tokens=max_tokens, temperature=0)
    if not stream:
        choice = oai.chat.completions.create(**asked).choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
        return Answer(calls, choice.message.content or "", {"length": "cut", "tool_calls": "whole"}[choice.finish_reason])
    text, calls, finish = "", {}, None
    for chunk in oai.chat.completions.create(**asked, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, ["", ""])
                call[0] += delta.function.name or ""
                call[1] += delta.function.arguments or ""
    return Answer([(n, json.loads(a)) for n, a in calls.values()], text, {"length": "cut", "tool_calls": "whole"}[finish])


def _messages(claude: anthropic.Anthropic, max_tokens: int, stream: bool) -> Answer:
    asked = dict(model=MODEL, max_tokens=max_tokens, messages=[{"role": "user", "content": QUESTION}],
                 tools=[{"name": "get_weather", "description": DESCRIPTION, "input_schema": PARAMETERS}],
                 tool_choice={"type": "any"}, extra_body={"temperature": 0})
    if stream:
        with claude.messages.stream(**asked) as events:
            message = events.get_final_message()
    else:
        message = claude.messages.create(**asked)
    calls = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    text = "".join(b.text for b in message.content if b.type == "text")
    return Answer(calls, text, {"max_tokens": "cut", "tool_use": "whole"}[message.stop_reason])


def _responses(oai: openai.OpenAI, max_tokens: int, stream: bool) -> Answer:
    tools = [{"type": "function", "name": "get_weather", "description": DESCRIPTION, "parameters": PARAMETERS}]
    asked = dict(model=MODEL, input=QUESTION, tools=tools,
                 tool_choice="required", max_output_tokens=max_tokens, temperature=0)
    if stream:
        events = list(oai.responses.create(**asked, stream=True))
        assert events[-1].type in ("response.completed", "response.incomplete")
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        response = events[-1].response
        assert deltas == response.output_text
    else:
        response = oai.responses.create(**asked)
    calls = [(o.name, json.loads(o.arguments)) for o in response.output if o.type == "function_call"]
    assert all(o.status == "completed" for o in response.output if o.type == "function_call")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    return Answer(calls, response.output_text, {"incomplete": "cut", "completed": "whole"}[response.status])


def _ask(api: str, clients: tuple[openai.OpenAI, anthropic.Anthropic], max_tokens: int, stream: bool) -> Answer:
    oai, claude = clients
    answer = {"chat": lambda: _chat(oai, max_tokens, stream), "messages": lambda: _messages(claude, max_tokens, stream),
              "responses": lambda: _responses(oai, max_tokens, stream)}[api]()
    assert not any(wire in answer.text for wire in WIRE), answer  # the format's wrapper never shows
    return answer


@pytest.fixture(scope="module")
def clients(oai: openai.OpenAI, claude: anthropic.Anthropic) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    return oai, claude


def _forced_request(engine: InferenceEngine, max_tokens: int) -> GenerateRequest:
    tools = [{"type": "function", "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": PARAMETERS}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "tools": tools, "tool_choice": "required",
            "max_tokens": max_tokens, "temperature": 0}
    return ChatCompletionsBuilder().prepare(body, ModelInfo(MODEL, 2048, 0, "generic", 49152, 576)).prepared.requests[0]


@pytest.fixture(scope="module")
def repeated_answer_tokens(engine: InferenceEngine) -> int:
    """The packaged model's greedy forced answer is a call, then the same call again: the engine ends it there
    (before the grammar would, and far before the token limit). Its length in tokens."""
    result = engine.submit(_forced_request(engine, 300)).wait(120)
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    repeated = call[:-1]  # ended as its arguments close
    assert result.finish_reason == "stop" and result.text == '{"tool_calls": [' + call + ", " + repeated, result.text
    return len(result.token_ids)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_a_call_cut_by_the_token_limit_is_dropped_and_the_whole_one_before_it_stays(
    api: str, stream: bool, clients, repeated_answer_tokens: int
) -> None:
    answer = _ask(api, clients, repeated_answer_tokens - 3, stream)  # cut inside the second call
    assert answer.ended == "cut" and answer.calls == [("get_weather", {"city": "Paris"})] and answer.text == ""
    inside_the_first = _ask(api, clients, 8, stream)
    assert inside_the_first == Answer([], "", "cut")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_a_model_repeating_its_call_stops_after_the_first(api: str, stream: bool, clients, repeated_answer_tokens: int) -> None:
    answer = _ask(api, clients, 300, stream)
    assert answer == Answer([("get_weather", {"city": "Paris"})], "", "whole")


def test_a_cut_text_answer_is_text(oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    bounded = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": bounded}}]
    ask = [{"role": "user", "content": "Tell me a story."}]
    reply = oai.chat.completions.create(model=MODEL, messages=ask, tools=tools, max_tokens=12, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.startswith("The story") and not any(w in choice.message.content for w in WIRE)
    message = claude.messages.create(
        model=MODEL, max_tokens=12, messages=ask, extra_body={"temperature": 0},
        tools=[{"name": "get_weather", "description": "The weather.", "input_schema": bounded}],
    )
    assert message.stop_reason == "max_tokens" and message.content[0].text == choice.message.content


CALL = '{"tool_calls": [{"name": "get_weather", "arguments": '


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_calls_under_auto_hold_to_their_schemas(api: str, engine: InferenceEngine) -> None:
    info = ModelInfo(MODEL, 2048, 0, "generic", 49152, 576)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
    body, builder = {
        "chat": ({"messages": [{"role": "user", "content": QUESTION}], "tools": [tool], "tool_choice": "auto"}, ChatCompletionsBuilder()),
        "messages": ({"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 50,
                      "tools": [{"name": "get_weather", "input_schema": PARAMETERS}], "tool_choice": {"type": "auto"}},
                     MessagesBuilder()),
        "responses": ({"input": QUESTION, "tools": [{"type": "function", "name": "get_weather", "parameters": PARAMETERS}],
                       "tool_choice": "auto"}, ResponsesBuilder()),
    }[api]
    request = builder.prepare({"model": MODEL, **body}, info).prepared.requests[0]
    assert request.structured_output is not None
    matcher = engine.grammars.matcher(request.structured_output)
    assert matcher.accept_string(CALL + '{"city": "Paris"}}]}')
    for wrong in (CALL + '{"town": ', '{"tool_calls": [{"name": "get_time"', CALL + '{"city": 1'):
        assert not engine.grammars.matcher(request.structured_output).accept_string(wrong), wrong


class Weather(pydantic.BaseModel):
    city: str
    summary: str


def test_tools_with_a_response_format_answer_in_it_or_call(oai: openai.OpenAI, server: InProcessServer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": Weather.model_json_schema()}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}]
    reply = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe the weather in Paris."}], tools=tools,
        response_format=fmt, temperature=0, max_tokens=150, extra_body={"max_string_tokens": 24},
    )
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason in ("stop", "tool_calls"), reply  # short strings: the answer is whole
    assert message.tool_calls or Weather.model_validate_json(message.content), message
    body = {"model": MODEL, "input": "Describe the weather in Paris.", "max_output_tokens": 150, "temperature": 0,
            "max_string_tokens": 24,
            "tools": [{"type": "function", "name": "get_weather", "parameters": PARAMETERS}],
            "text": {"format": {"type": "json_schema", "name": "weather", "schema": Weather.model_json_schema()}}}
    response = httpx.post(f"{server.url}/v1/responses", json=body, timeout=120).json()
    assert response["status"] == "completed", response
    kinds = [item["type"] for item in response["output"]]
    if "function_call" not in kinds:
        Weather.model_validate_json(response["output"][0]["content"][0]["text"])


@pytest.mark.parametrize("model_class", ["OpenAIResponsesModel", "OpenAIChatCompletionsModel"])
def test_the_agents_sdk_gets_a_final_output_of_its_type_with_tools(server: InProcessServer, model_class: str) -> None:
    import agents

    agents.set_tracing_disabled(True)
    used: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        used.append(city)
        return f"18 degrees and sunny in {city}"

    async def run() -> object:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        agent = agents.Agent(
            name="weather", instructions="Answer with the weather.", tools=[get_weather], output_type=Weather,
            model=getattr(agents, model_class)(model=MODEL, openai_client=client),
            model_settings=agents.ModelSettings(temperature=0, max_tokens=150, extra_body={"max_string_tokens": 24}),
        )
        return (await agents.Runner.run(agent, "Describe the weather in Paris.", max_turns=4)).final_output

    assert isinstance(asyncio.run(run()), Weather)
