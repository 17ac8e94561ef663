"""Thinking apart from the answer on every API, streamed and not: a tiny random model with Qwen3's real template and
tokens behind `reasoning_parser: qwen3`, checked against the engine's own split of the same request. A budget closes
the span, so each answer has both parts: vLLM's `thinking_token_budget` on chat, the least the other APIs take (1,024
tokens: `reasoning.effort: low`, Anthropic's least `budget_tokens`) elsewhere."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from serve_app.engine.engine import InferenceEngine
from serve_app.wire.outputs import RequestOutput
from serve_app.wire.requests import GenerateRequest
from tests.inprocess import MODEL, InProcessServer, anthropic_client, engine_server, openai_client

CHAT = [{"role": "user", "content": "What is 2 + 2?"}]
BUDGET = 1024  # reasoning.effort low; Anthropic's least budget_tokens
MAX_TOKENS = BUDGET + 12
SHORT = 6  # chat's own budget


@pytest.fixture(scope="module")
def thinking_server(thinker: InferenceEngine) -> Iterator[InProcessServer]:
    with engine_server(thinker) as server:
        yield server


def split(engine: InferenceEngine, budget: int, max_tokens: int) -> RequestOutput:
    """The engine's own split of the greedy answer under `budget`: what every API must return."""
    request = GenerateRequest(messages=CHAT, max_tokens=max_tokens, temperature=0, thinking_token_budget=budget)
    result = engine.submit(request).wait(timeout=300)
    assert result.reasoning and result.text  # the budget closed the span before the answer
    return result


@pytest.fixture(scope="module")
def expected(thinker: InferenceEngine) -> RequestOutput:
    return split(thinker, BUDGET, MAX_TOKENS)


@pytest.fixture(scope="module")
def oai_thinker(thinking_server: InProcessServer) -> openai.OpenAI:
    return openai_client(thinking_server.url)


@pytest.fixture(scope="module")
def claude_thinker(thinking_server: InProcessServer) -> anthropic.Anthropic:
    return anthropic_client(thinking_server.url)


def test_chat_returns_reasoning_content_apart_streamed_or_not(oai_thinker: openai.OpenAI, thinker: InferenceEngine) -> None:
    expected = split(thinker, SHORT, SHORT + 8)
    fields = dict(
        model=MODEL, messages=CHAT, max_tokens=SHORT + 8, temperature=0, extra_body={"thinking_token_budget": SHORT}
    )
    whole = oai_thinker.chat.completions.create(**fields)
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"] == expected.reasoning and message.content == expected.text
    assert whole.usage.completion_tokens_details.reasoning_tokens == expected.usage.reasoning_tokens
    reasoning, content = [], []
    for chunk in oai_thinker.chat.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            reasoning.append((choice.delta.model_extra or {}).get("reasoning_content") or "")
            content.append(choice.delta.content or "")
    assert "".join(reasoning) == expected.reasoning and "".join(content) == expected.text


def test_chat_can_leave_the_thinking_out_or_not_think(oai_thinker: openai.OpenAI, thinker: InferenceEngine) -> None:
    left_out = oai_thinker.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, extra_body={"include_reasoning": False}
    )
    assert "reasoning_content" not in (left_out.choices[0].message.model_extra or {})
    assert left_out.usage.completion_tokens_details.reasoning_tokens == 4
    none = oai_thinker.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, reasoning_effort="none")
    off = GenerateRequest(messages=CHAT, max_tokens=6, temperature=0, chat_template_kwargs={"enable_thinking": False})
    assert none.choices[0].message.content == thinker.submit(off).wait(timeout=60).text
    assert none.usage.completion_tokens_details.reasoning_tokens == 0


def test_tools_hold_the_answer_after_the_thinking(oai_thinker: openai.OpenAI) -> None:
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    answer = oai_thinker.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=SHORT + 40, temperature=0, tools=[tool], tool_choice="required",
        extra_body={"max_string_tokens": 4, "thinking_token_budget": SHORT},
    )
    message = answer.choices[0].message
    assert message.model_extra["reasoning_content"]
    (call,) = message.tool_calls[:1]
    assert call.function.name == "add" and isinstance(json.loads(call.function.arguments)["a"], int)


def test_messages_return_thinking_blocks_streamed_or_not(claude_thinker: anthropic.Anthropic, expected: RequestOutput) -> None:
    fields = dict(
        model=MODEL, max_tokens=MAX_TOKENS, messages=CHAT, thinking={"type": "enabled", "budget_tokens": BUDGET},
        extra_body={"temperature": 0},
    )
    whole = claude_thinker.messages.create(**fields)
    assert [block.type for block in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == expected.reasoning and whole.content[1].text == expected.text
    with claude_thinker.messages.stream(**fields) as stream:
        kinds = [event.delta.type for event in stream if event.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert kinds.count("signature_delta") == 1 and "thinking_delta" in kinds and "text_delta" in kinds
    assert [block.model_dump() for block in streamed.content] == [block.model_dump() for block in whole.content]
    # The signed block goes back with the conversation; an altered one is refused.
    back = [*CHAT, {"role": "assistant", "content": whole.content}, {"role": "user", "content": "And 3 + 3?"}]
    assert claude_thinker.messages.create(model=MODEL, max_tokens=2, messages=back).content
    back[1]["content"] = [{**whole.content[0].model_dump(), "thinking": "altered"}, whole.content[1].model_dump()]
    with pytest.raises(anthropic.BadRequestError, match="signature"):
        claude_thinker.messages.create(model=MODEL, max_tokens=2, messages=back)


def test_messages_without_thinking_do_not_think(claude_thinker: anthropic.Anthropic) -> None:
    message = claude_thinker.messages.create(model=MODEL, max_tokens=6, messages=CHAT, extra_body={"temperature": 0})
    assert [block.type for block in message.content] == ["text"] and message.content[0].text
    # Counting renders the prompt as the message does, thinking or not (Qwen3's template differs by its empty span).
    usage = message.usage
    prompt = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    assert claude_thinker.messages.count_tokens(model=MODEL, messages=CHAT).input_tokens == prompt
    enabled = {"type": "enabled", "budget_tokens": BUDGET}
    thought = claude_thinker.messages.count_tokens(model=MODEL, messages=CHAT, thinking=enabled).input_tokens
    assert thought == prompt - 4  # without `<think>\n\n</think>\n\n`


def test_a_budget_must_be_below_max_tokens(thinking_server: InProcessServer) -> None:
    body = {"model": MODEL, "max_tokens": 1024, "messages": CHAT, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    answer = httpx.post(f"{thinking_server.url}/v1/messages", json=body)
    assert answer.status_code == 400 and "budget_tokens" in answer.json()["error"]["message"]


def test_responses_return_a_reasoning_item_streamed_or_not(oai_thinker: openai.OpenAI, expected: RequestOutput) -> None:
    fields = dict(model=MODEL, input=CHAT, max_output_tokens=MAX_TOKENS, temperature=0, reasoning={"effort": "low"})
    whole = oai_thinker.responses.create(**fields)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == expected.reasoning and whole.output_text == expected.text
    assert whole.usage.output_tokens_details.reasoning_tokens == expected.usage.reasoning_tokens
    assert whole.reasoning.effort == "low"
    with oai_thinker.responses.stream(**fields) as stream:
        events = list(stream)
    deltas = [event.delta for event in events if event.type == "response.reasoning_text.delta"]
    (streamed,) = [event.response for event in events if event.type == "response.incomplete"]  # max_output_tokens cut it
    assert "".join(deltas) == expected.reasoning
    assert [item.type for item in streamed.output] == ["reasoning", "message"] and streamed.output_text == expected.text
    # The output goes back as input, its reasoning item with it.
    again = [*CHAT, *[item.model_dump(exclude_none=True) for item in whole.output], {"role": "user", "content": "More."}]
    assert oai_thinker.responses.create(model=MODEL, input=again, max_output_tokens=2).output


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/chat/completions", {"messages": CHAT, "reasoning_effort": "low"}, "reasoning_effort"),
        ("/v1/chat/completions", {"messages": CHAT, "thinking_token_budget": 8}, "thinking_token_budget"),
        ("/v1/responses", {"input": "hi", "reasoning": {"effort": "low"}}, "reasoning.effort"),
        ("/v1/messages", {"max_tokens": 2000, "messages": CHAT, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ],
)
def test_a_model_that_does_not_reason_refuses_reasoning(server: InProcessServer, path: str, body: dict, param: str) -> None:
    answer = httpx.post(f"{server.url}{path}", json={"model": MODEL, **body})
    assert answer.status_code == 400 and f"{param}: this model does not reason" in answer.text
