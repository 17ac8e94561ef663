"""Tool calling on `/v1/chat/completions` in the generic format, with the official OpenAI SDK.

The embedded model's template ignores tools, so the tools are described in a system message and
a grammar forces the answer: a call whose arguments match the tool's schema, or (`auto`) text.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.inprocess import MODEL, InProcessServer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 40}}, "required": ["zone"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _arguments_valid(call, tool: dict) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_required_forces_a_call_whose_arguments_match_the_schema(oai: openai.OpenAI, temperature: float) -> None:
    reply = oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=200,
        temperature=temperature, seed=4,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls, choice.message
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        _arguments_valid(call, {"get_weather": WEATHER, "get_time": TIME}[call.function.name])


def test_a_named_tool_is_the_one_called_once_without_parallel_calls(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=200, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False,
    )
    calls = reply.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    _arguments_valid(calls[0], TIME)


def test_auto_answers_in_text_or_a_call_and_none_answers_in_text(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                        tools=[WEATHER], max_tokens=80, temperature=0)
    message = reply.choices[0].message
    if reply.choices[0].finish_reason == "tool_calls":
        _arguments_valid(message.tool_calls[0], WEATHER)
    else:
        assert reply.choices[0].finish_reason == "stop" and message.content and not message.tool_calls
        assert not message.content.lstrip().startswith("{")  # the answer, not the JSON it came in
    plain = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                        max_tokens=8, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


def test_streamed_calls_assemble_as_the_sdk_expects(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=200, temperature=0,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": "", "pieces": 0})
                if delta.id:
                    assert call["id"] is None and delta.function.name  # the first delta carries id and name
                    call["id"], call["name"] = delta.id, delta.function.name
                call["arguments"] += delta.function.arguments or ""
                call["pieces"] += bool(delta.function.arguments)
    assert finish == "tool_calls" and calls
    for call in calls.values():
        assert call["id"].startswith("call_") and call["name"] == "get_weather"
        assert call["pieces"] == 1  # a call streams once its arguments are whole: a cut call never shows
        jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])


def test_a_streamed_text_answer_under_auto_comes_as_it_is_written(oai: openai.OpenAI) -> None:
    hello = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "tools": [WEATHER],
             "max_tokens": 60, "temperature": 0}
    whole = oai.chat.completions.create(**hello).choices[0]
    assert whole.finish_reason == "stop" and whole.message.content and not whole.message.tool_calls
    pieces, finish = [], None
    for chunk in oai.chat.completions.create(**hello, stream=True):
        for choice in chunk.choices:
            assert not choice.delta.tool_calls
            pieces += [choice.delta.content] if choice.delta.content else []
            finish = choice.finish_reason or finish
    assert finish == "stop" and "".join(pieces) == whole.message.content  # the answer, not its JSON wrapping
    assert len(pieces) > 3


def test_a_whole_tool_loop(oai: openai.OpenAI) -> None:
    first = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                        max_tokens=200, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    final = oai.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                        max_tokens=40, temperature=0)
    assert final.choices[0].message.content and final.choices[0].message.tool_calls is None
    # The call and its result reached the model: the prompt is longer than the question alone by more than the result.
    alone = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=1)
    assert final.usage.prompt_tokens > alone.usage.prompt_tokens + len("18 degrees and sunny".split())


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
        ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": "nonsense"}}}]}, "tools"),
        ({"functions": [WEATHER["function"]]}, "functions"),
    ],
)
def test_tool_refusals_name_the_field(server: InProcessServer, body: dict, param: str) -> None:
    resp = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body},
                      timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.json()


# -- Anthropic's Messages API -------------------------------------------------------------------

CLAUDE_WEATHER = {"name": "get_weather", "description": WEATHER["function"]["description"],
                  "input_schema": WEATHER["function"]["parameters"]}
CLAUDE_TIME = {"name": "get_time", "description": TIME["function"]["description"],
               "input_schema": TIME["function"]["parameters"]}


def test_anthropic_any_forces_tool_use_blocks(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model=MODEL, max_tokens=200, messages=ASK, tools=[CLAUDE_WEATHER, CLAUDE_TIME], tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )
    assert message.stop_reason == "tool_use"
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses and all(block.id.startswith("toolu_") for block in uses)
    for block in uses:
        schema = {"get_weather": CLAUDE_WEATHER, "get_time": CLAUDE_TIME}[block.name]["input_schema"]
        jsonschema.validate(block.input, schema)


def test_anthropic_streamed_tool_use_and_a_tool_loop(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(
        model=MODEL, max_tokens=200, messages=ASK, tools=[CLAUDE_WEATHER],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds.count("input_json") == 1  # the input streams once whole: a cut call never shows
    assert final.stop_reason == "tool_use" and len(final.content) == 1
    use = final.content[0]
    assert use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, CLAUDE_WEATHER["input_schema"])
    history = [
        *ASK,
        {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 degrees and sunny"}]},
    ]
    answer = claude.messages.create(model=MODEL, max_tokens=40, messages=history, tools=[CLAUDE_WEATHER],
                                    tool_choice={"type": "none"}, extra_body={"temperature": 0})
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    assert answer.content[0].text


def test_anthropic_count_tokens_counts_the_tools(claude: anthropic.Anthropic, server: InProcessServer) -> None:
    plain = claude.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    with_tools = claude.messages.count_tokens(model=MODEL, messages=ASK, tools=[CLAUDE_WEATHER]).input_tokens
    assert with_tools > plain + 20
    url = f"{server.url}/v1/messages"
    named = {"model": MODEL, "max_tokens": 4, "messages": ASK, "tools": [CLAUDE_WEATHER],
             "tool_choice": {"type": "tool", "name": "nope"}}
    resp = httpx.post(url, json=named, timeout=60)
    assert resp.status_code == 400 and "tool_choice" in resp.json()["error"]["message"]
    bad = {"model": MODEL, "max_tokens": 4, "messages": ASK, "tools": [{**CLAUDE_WEATHER, "input_schema": {"type": "nonsense"}}]}
    resp = httpx.post(url, json=bad, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
