"""Tool calling in a chat template's own format (`hermes`, `llama3_json`), with the official SDKs.

Tiny random models carry test templates that take `tools` (tests/templates): the template renders
the tools and the history, xgrammar's structural tag for the format forces the calls, and the
answer is read back into each API's shapes. The models are random, so the tests check what the
grammar and the parser guarantee, not what a model would choose.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest

from serve_app.engine.engine import InferenceEngine
from serve_app.http.protocols.anthropic import MessagesBuilder
from serve_app.http.protocols.openai import ChatCompletionsBuilder
from serve_app.http.tools import format_for
from serve_app.http.tools.plan import ParsedOutput, ToolSpec, plan, read_answer
from serve_app.model.tokenizer import template_tool_format
from serve_app.wire.model_card import ModelInfo
from serve_app.wire.requests import StructuredOutput
from tests.inprocess import (
    MODEL,
    InProcessServer,
    anthropic_client,
    engine_server,
    openai_client,
)
from tests.tiny_models import build_tiny_model

TEMPLATES = Path(__file__).parents[1] / "templates"
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": PARAMETERS}}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time", "description": "The time.",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    {"role": "user", "content": "And in Rome?"},
]


def _engine(tmp_path_factory: pytest.TempPathFactory, model_path: Path, template: str, **options) -> InferenceEngine:
    folder = build_tiny_model("qwen3", tmp_path_factory.mktemp(template), model_path, chat_template=TEMPLATES / template)
    return InferenceEngine(compile=False, model=str(folder), kv_cache="paged", page_size=16, cache_tokens=4096, max_model_len=1024, **options)


@pytest.fixture(scope="module")
def hermes(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[InferenceEngine]:
    eng = _engine(tmp_path_factory, model_path, "hermes_tools.jinja")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hermes_server(hermes: InferenceEngine) -> Iterator[InProcessServer]:
    with engine_server(hermes) as srv:
        yield srv


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[InProcessServer]:
    eng = _engine(tmp_path_factory, model_path, "llama3_json_tools.jinja")
    with engine_server(eng) as srv:
        yield srv
    eng.shutdown()


def _valid(arguments: str | dict, tool: dict) -> None:
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(value, tool["function"]["parameters"])


# -- which format, and how the conversation is rendered -------------------------------------------------------


def test_the_chat_template_decides_the_format_and_the_config_can_override_it(
    hermes: InferenceEngine, tmp_path_factory: pytest.TempPathFactory, model_path: Path
) -> None:
    assert template_tool_format((TEMPLATES / "hermes_tools.jinja").read_text()) == "hermes"
    assert template_tool_format((TEMPLATES / "llama3_json_tools.jinja").read_text()) == "llama3_json"
    assert template_tool_format((model_path / "chat_template.jinja").read_text()) == "generic"  # SmolLM2 ignores tools
    assert hermes.tool_format == "hermes"
    forced = _engine(tmp_path_factory, model_path, "hermes_tools.jinja", tool_call_format="generic")
    try:
        assert forced.tool_format == "generic"
    finally:
        forced.shutdown()


def test_both_apis_render_tools_and_history_through_the_template(hermes: InferenceEngine) -> None:
    info = ModelInfo(MODEL, 1024, 0, "hermes", 49152, 576)
    chat = ChatCompletionsBuilder().prepare(
        {"model": MODEL, "messages": HISTORY, "tools": [WEATHER], "max_tokens": 8}, info
    ).prepared.requests[0]
    claude = MessagesBuilder().prepare(
        {
            "model": MODEL, "max_tokens": 8, "system": "Be brief.",
            "tools": [{"name": "get_weather", "description": "The weather.", "input_schema": PARAMETERS}],
            "messages": [
                *ASK,
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris", "unit": "celsius"}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "call_1", "content": "18 degrees"},
                    {"type": "text", "text": "And in Rome?"},
                ]},
            ],
        },
        info,
    ).prepared.requests[0]
    text = hermes.tokenizer.apply_chat_template(chat.messages, tools=chat.tools)
    assert "<tools>" in text and '"name": "get_weather"' in text and "Be brief." in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in text
    assert "<tool_response>\n18 degrees\n</tool_response>" in text
    assert text == hermes.tokenizer.apply_chat_template(claude.messages, tools=claude.tools)
    assert chat.structured_output is not None and chat.structured_output.tool_calls.format == "hermes"


def test_auto_lets_text_come_first_and_holds_calls_to_their_schemas(hermes: InferenceEngine) -> None:
    spec = ToolSpec("get_weather", "", PARAMETERS)
    constraint: StructuredOutput = format_for("hermes").constraint(plan([spec], "auto"))
    good = hermes.grammars.matcher(constraint)
    assert good.accept_string('Let me look. <tool_call>\n{"name": "get_weather", "arguments": ')
    assert good.accept_string('{"city": "Paris", "unit": "celsius"}}\n</tool_call>')
    unknown = hermes.grammars.matcher(constraint)
    assert not unknown.accept_string('<tool_call>\n{"name": "get_time", ')
    off_schema = hermes.grammars.matcher(constraint)
    assert not off_schema.accept_string('<tool_call>\n{"name": "get_weather", "arguments": {"town": ')


def test_with_a_response_format_an_auto_answer_is_its_json_or_calls(hermes: InferenceEngine) -> None:
    spec = ToolSpec("get_weather", "", PARAMETERS)
    answer = {"type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]}
    constraint = format_for("hermes").constraint(plan([spec], "auto"), answer)
    assert hermes.grammars.matcher(constraint).accept_string('{"summary": "Sunny."}')
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    assert hermes.grammars.matcher(constraint).accept_string(call)
    assert not hermes.grammars.matcher(constraint).accept_string("Sunny")  # free text is not the format
    assert not hermes.grammars.matcher(constraint).accept_string('{"weather": ')


def _parse(name: str, text: str, id_prefix: str = "call_") -> ParsedOutput:
    constraint = format_for(name).constraint(plan([ToolSpec("a", "", {})], "auto"))
    return read_answer(constraint, text, True, id_prefix)


def test_calls_are_read_back_with_the_text_around_them() -> None:
    hermes = _parse(
        "hermes",
        'Checking both.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
    )
    assert hermes.content == "Checking both." and [(c.name, json.loads(c.arguments)) for c in hermes.calls] == [
        ("a", {"x": 1}), ("b", {}),
    ]
    llama = _parse(
        "llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": "z"}}', "toolu_"
    )
    assert llama.content is None and [c.name for c in llama.calls] == ["a", "b"]
    assert all(c.id.startswith("toolu_") for c in llama.calls)
    broken = _parse("hermes", '<tool_call>\n{"name": "a", "argu\n</tool_call>')
    assert broken.calls == () and broken.content.startswith("<tool_call>")
    assert _parse("llama3_json", "no calls here").calls == ()


# -- the OpenAI SDK ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"]
)
def test_hermes_calls_match_their_schemas(hermes_server: InProcessServer, choice) -> None:
    client = openai_client(hermes_server.url)
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False,
        max_tokens=80, temperature=0,
    )
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    assert call.id.startswith("call_") and (choice == "required" or call.function.name == "get_time")
    _valid(call.function.arguments, {"get_weather": WEATHER, "get_time": TIME}[call.function.name])


def test_hermes_streamed_call_and_tool_loop(hermes_server: InProcessServer) -> None:
    client = openai_client(hermes_server.url)
    with client.chat.completions.stream(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
        max_tokens=80, temperature=0,
    ) as stream:
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert final.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    _valid(call.function.arguments, WEATHER)
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                            max_tokens=8, temperature=0)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content
    alone = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=1)
    assert answer.usage.prompt_tokens > alone.usage.prompt_tokens + 10  # the call and its result reached the model


def test_llama3_json_calls_and_a_history_its_template_refuses(llama3: InProcessServer) -> None:
    client = openai_client(llama3.url)
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80, temperature=0,
    )
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
    _valid(calls[0].function.arguments, WEATHER)
    two_calls = [*ASK, {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "18"}, {"role": "tool", "tool_call_id": "call_2", "content": "19"}]
    resp = httpx.post(f"{llama3.url}/v1/chat/completions", json={"model": MODEL, "messages": two_calls, "max_tokens": 4}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages", resp.text
    assert "one tool call per message" in resp.json()["error"]["message"]
    again = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    assert again.choices[0].message.content is not None


# -- the Anthropic SDK ------------------------------------------------------------------------------------------


def test_hermes_tool_use_blocks_whole_and_streamed(hermes_server: InProcessServer) -> None:
    client = anthropic_client(hermes_server.url)
    tool = {"name": "get_weather", "description": "The weather.", "input_schema": PARAMETERS}
    choice = {"type": "any", "disable_parallel_tool_use": True}
    message = client.messages.create(model=MODEL, max_tokens=80, messages=ASK, tools=[tool], tool_choice=choice,
                                     extra_body={"temperature": 0})
    uses = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and len(uses) == 1 and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, PARAMETERS)
    with client.messages.stream(model=MODEL, max_tokens=80, messages=ASK, tools=[tool], tool_choice=choice,
                                extra_body={"temperature": 0}) as stream:
        streamed = stream.get_final_message()
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [uses[0].input]  # greedy: the same call
    counted = client.messages.count_tokens(model=MODEL, messages=ASK, tools=[tool]).input_tokens
    assert counted == message.usage.input_tokens + message.usage.cache_read_input_tokens
