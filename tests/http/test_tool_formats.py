"""Tool calls in Mistral's, Qwen3-Coder's, DeepSeek-V3.1's and gpt-oss's own formats, each with its family's real chat template
(llama.cpp's copies, `tests.model_families`): the format is read off the template or named by `tool_call_parser`,
both APIs' histories render through the template in its syntax, and calls a tiny random model is made to write by
the format's grammar are read back, whole and streamed, with the official SDKs. The tiny models' tokenizer has each
family's markers as tokens of their own, special where the family's are (Mistral's, DeepSeek's)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import pytest

from serve_app.engine.engine import InferenceEngine
from serve_app.engine.harmony import MARKERS as HARMONY_MARKERS
from serve_app.http.protocols.anthropic import MessagesBuilder
from serve_app.http.protocols.openai import ChatCompletionsBuilder
from serve_app.model.tokenizer import template_tool_format
from serve_app.wire.model_card import ModelInfo
from tests.inprocess import MODEL, InProcessServer, anthropic_client, engine_server, openai_client
from tests.model_families import template
from tests.tiny_models import build_tiny_model, tokenizer_with_tokens

TEMPLATES = {
    "mistral": "Mistral-Small-3.2-24B-Instruct-2506",
    "qwen3_coder": "Qwen3-Coder",
    "deepseek_v31": "deepseek-ai-DeepSeek-V3.1",
    "openai": "openai-gpt-oss-120b",
}
# How each format writes the history's call to get_weather(city="Paris", days=2) in its template.
RENDERED_CALL = {
    "mistral": '[TOOL_CALLS]get_weather[CALL_ID]{id}[ARGS]{{"city": "Paris", "days": 2}}',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
    "deepseek_v31": '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{{"city": "Paris", "days": 2}}<｜tool▁call▁end｜>',
    "openai": '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{{"city": "Paris", "days": 2}}<|call|>',
}
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": PARAMETERS}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}
# Mistral's template wants the assistant's answer to a tool result before the next user turn.
HISTORY = [
    {"role": "system", "content": "Be brief."}, *ASK, {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}, {"role": "assistant", "content": "It is 18."},
    {"role": "user", "content": "And in Rome?"},
]


# The markers each family's tokenizer has as tokens of their own (special: left out of text unless kept).
MARKERS = {
    "mistral": (["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"], True),
    "qwen3_coder": (["<tool_call>", "</tool_call>"], False),
    "deepseek_v31": (["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"], True),
    "openai": (list(HARMONY_MARKERS), True),
}
# gpt-oss ends its output at <|call|> and <|return|> (its generation config's end ids), the markers' 5th and 6th.
END_IDS = {"openai": [2, 49152 + 4, 49152 + 5]}
# gpt-oss thinks in its analysis channel unless told not to: here the grammar then holds the calls from the start.
NO_THINKING = {"openai": {"reasoning_effort": "none"}}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[tuple[str, InProcessServer]]:
    name = request.param
    tokenizer = tokenizer_with_tokens(model_path, tmp_path_factory.mktemp(f"{name}-tokenizer"), *MARKERS[name])
    folder = build_tiny_model(
        "qwen3", tmp_path_factory.mktemp(name), tokenizer, chat_template=template(TEMPLATES[name]),
        max_position_embeddings=4096, vocab_size=49152 + len(MARKERS[name][0]), eos_token_id=END_IDS.get(name, 2),
    )
    engine = InferenceEngine(compile=False, model=str(folder), cache_tokens=4096, max_model_len=2048)
    assert engine.tool_format == name  # read off the family's template
    with engine_server(engine) as server:
        yield name, server
    engine.shutdown()


def test_each_familys_template_names_its_format() -> None:
    for name, family in TEMPLATES.items():
        assert template_tool_format(template(family).read_text()) == name
    # DeepSeek-R1's calls (the type before the name) and Mistral-Nemo's JSON list are not these formats.
    assert template_tool_format(template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B").read_text()) == "generic"


def test_tool_call_parser_names_the_format(tmp_path: Path, model_path: Path) -> None:
    folder = build_tiny_model("llama", tmp_path / "m", model_path, chat_template=template(TEMPLATES["qwen3_coder"]))
    engine = InferenceEngine(compile=False, model=str(folder), cache_tokens=1024, tool_call_parser="mistral")
    try:
        assert engine.tool_format == "mistral"
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="tool_call_parser"):
        InferenceEngine(compile=False, model=str(folder), tool_call_parser="mistral", tool_call_format="hermes")


def test_both_apis_histories_render_in_the_formats_syntax(served: tuple[str, InProcessServer]) -> None:
    name, server = served
    info = ModelInfo(MODEL, 2048, 0, name, 49152, 64)
    engine = server.context.models.client_of({"model": MODEL}).engine
    chat = ChatCompletionsBuilder().prepare({"model": MODEL, "messages": HISTORY, "tools": [WEATHER], "max_tokens": 8}, info)
    uses = [{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris", "days": 2}}]
    results = [{"type": "tool_result", "tool_use_id": "call_1", "content": "18 degrees"}]
    claude = MessagesBuilder().prepare({
        "model": MODEL, "max_tokens": 8, "system": "Be brief.",
        "tools": [{"name": "get_weather", "description": "The weather.", "input_schema": PARAMETERS}],
        "messages": [*ASK, {"role": "assistant", "content": uses}, {"role": "user", "content": results},
                     {"role": "assistant", "content": "It is 18."}, {"role": "user", "content": "And in Rome?"}],
    }, info)
    rendered = [
        engine.tokenizer.apply_chat_template(r.messages, tools=r.tools)
        for r in (chat.prepared.requests[0], claude.prepared.requests[0])
    ]
    assert rendered[0] == rendered[1]  # one conversation, whichever API sent it
    expected = RENDERED_CALL[name].format(id="call_1" if name != "mistral" else _mistral_id("call_1"))
    assert expected in rendered[0] and "18 degrees" in rendered[0]
    assert rendered[0].count("The weather.") == 1  # the tool, described once


def _mistral_id(call_id: str) -> str:
    """9 hex digits of the id's SHA-256: the 9 letters and digits Mistral's templates take."""
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


@pytest.mark.parametrize("parallel", [False, True], ids=["one", "parallel"])
def test_calls_are_read_back_whole_and_streamed(served: tuple[str, InProcessServer], parallel: bool) -> None:
    name, server = served
    client = openai_client(server.url)
    fields = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=parallel,
                  max_tokens=300, temperature=0, **NO_THINKING.get(name, {}))
    reply = client.chat.completions.create(**fields)
    calls = reply.choices[0].message.tool_calls
    # One call ends the answer; parallel calls go on until the model stops or max_tokens cuts the next one off.
    finish = ("tool_calls", "length") if parallel else ("tool_calls",)
    assert reply.choices[0].finish_reason in finish and calls and (parallel or len(calls) == 1), reply
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS)
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(**fields, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            streamed[delta.index] = streamed.get(delta.index, "") + (delta.function.arguments or "")
    # Greedy: the same calls (streamed as written, whole ones as JSON re-serialized).
    assert [json.loads(streamed[i]) for i in sorted(streamed)] == [json.loads(c.function.arguments) for c in calls]


def test_tool_use_blocks_through_the_anthropic_sdk(served: tuple[str, InProcessServer]) -> None:
    _, server = served
    client: anthropic.Anthropic = anthropic_client(server.url)
    tool = {"name": "get_weather", "description": "The weather.", "input_schema": PARAMETERS}
    message = client.messages.create(
        model=MODEL, max_tokens=300, messages=ASK, tools=[tool], extra_body={"temperature": 0},
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, PARAMETERS)


def test_max_string_tokens_needs_json_strings(served: tuple[str, InProcessServer]) -> None:
    name, server = served
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 300,
            "max_string_tokens": 4, **NO_THINKING.get(name, {})}
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    if name == "qwen3_coder":  # its values are XML text, not JSON strings
        assert answer.status_code == 400 and "max_string_tokens" in answer.text
    else:
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["tool_calls"]
