"""gpt-oss's harmony channels (`reasoning_parser: openai_gptoss`, the default of its template): a tiny random model
with gpt-oss's real chat template and its markers as special tokens. A written answer's analysis is its reasoning
and its final message the answer, token by token; a tool-mode answer keeps its headers and reads back as a call;
grammars hold the message stream, asking for the markers as tokens (an analysis where thinking is allowed, closed by
its budget, then the final message the constraint holds); `reasoning_effort` reaches the template; the OpenAI SDK
gets the reasoning apart from the answer, whole and streamed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from serve_app.answers.harmony import HarmonyReader
from serve_app.answers.reader import CallPart
from serve_app.engine.engine import InferenceEngine
from serve_app.engine.output_processor import OutputProcessor
from serve_app.engine.task import Task, TaskAdmission, TaskSampling
from serve_app.engine.task_output import TaskOutput
from serve_app.http.protocols.openai import ChatCompletionsBuilder
from serve_app.wire.outputs import CoreOutput, RequestOutput, StreamDelta, merge_deltas
from serve_app.wire.requests import EncodedRequest, GenerateRequest, SamplingParams, StructuredOutput
from tests.inprocess import MODEL, engine_server, openai_client

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}
THOUGHT = "<|channel|>analysis<|message|>Two and two make four.<|end|>"


@pytest.fixture(scope="module")
def harmony(tiny_harmony_path: Path) -> Iterator[InferenceEngine]:
    engine = InferenceEngine(str(tiny_harmony_path), compile=False, cache_tokens=4096)
    yield engine
    engine.shutdown()


def written(engine: InferenceEngine, answer: str, keep_headers: bool) -> StreamDelta:
    """`answer` as if the model wrote it, token by token, through a request's task and its output processor."""
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)
    outputs: list[CoreOutput] = []
    thinking = engine.reasoning_markers.span(prompt, None, keep_headers)  # type: ignore[union-attr]
    output = TaskOutput(lambda _, published: outputs.append(published), thinking=thinking)
    sampling = TaskSampling(SamplingParams(temperature=0), engine.tokenizer.eos_token_ids)
    task = Task(0, len(prompt), list(prompt), 200, sampling, output, TaskAdmission(""))
    for token in engine.tokenizer.encode(answer, add_special_tokens=False):
        accepted = task.accept(token, 4096)
        task.publish(accepted)
        if accepted.finish_reason is not None:
            break
    request = GenerateRequest(messages=MESSAGES, skip_special_tokens=not keep_headers)
    processor = OutputProcessor(engine.tokenizer, EncodedRequest(request, prompt))
    return merge_deltas([delta for o in outputs if (delta := processor.process(o)) is not None])


def test_the_template_makes_it_a_harmony_model(harmony: InferenceEngine) -> None:
    assert harmony.tool_format == "openai" and harmony.reasoning_parser == "openai_gptoss"
    assert harmony.tokenizer.apply_chat_template(MESSAGES).endswith("<|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant")
    with pytest.raises(ValueError, match="answers in channels"):
        InferenceEngine(str(harmony.runner.path), compile=False, reasoning_parser="qwen3")


def test_the_analysis_is_the_reasoning_and_the_final_message_the_answer(harmony: InferenceEngine) -> None:
    result = written(harmony, f"{THOUGHT}<|start|>assistant<|channel|>final<|message|>It is four.<|return|>", False)
    assert result.reasoning == "Two and two make four." and result.text == "It is four."
    assert result.finish_reason == "stop"
    assert result.usage.reasoning_tokens == len(harmony.tokenizer.encode(THOUGHT, add_special_tokens=False))


def test_a_tool_mode_answer_keeps_its_headers_and_reads_back_as_a_call(harmony: InferenceEngine) -> None:
    call = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
    result = written(harmony, THOUGHT + call, True)
    assert result.reasoning == "Two and two make four." and result.finish_reason == "stop"
    assert result.text.startswith("<|channel|>analysis<|message|><|end|><|start|>assistant<|channel|>commentary")
    reader = HarmonyReader()
    assert [*reader.feed(result.text), *reader.finish(True)] == [CallPart("get_weather", '{"city": "Paris"}')]


def run(engine: InferenceEngine, **fields) -> RequestOutput:
    return engine.submit(GenerateRequest(messages=MESSAGES, temperature=0, **fields)).wait(timeout=120)


def test_without_thinking_the_grammar_asks_for_the_final_message_at_once(harmony: InferenceEngine) -> None:
    result = run(harmony, max_tokens=40, structured_output=StructuredOutput(json=SCHEMA), thinking_token_budget=0)
    tokenizer, ids = harmony.tokenizer, result.token_ids
    channel, message = tokenizer.token_id("<|channel|>"), tokenizer.token_id("<|message|>")
    assert ids[0] == channel and message in ids  # the markers, as tokens
    assert tokenizer.decode(ids[: ids.index(message) + 1], skip_special_tokens=False) == "<|channel|>final<|message|>"
    assert result.finish_reason == "stop" and json.loads(result.text)["a"] in ("x", "y") and result.reasoning == ""


def test_a_budget_closes_the_analysis_and_the_final_message_holds_the_answer(harmony: InferenceEngine) -> None:
    result = run(harmony, max_tokens=60, structured_output=StructuredOutput(json=SCHEMA), thinking_token_budget=4)
    tokenizer, ids = harmony.tokenizer, result.token_ids
    raw = tokenizer.decode(ids, skip_special_tokens=False)
    assert result.finish_reason == "stop" and json.loads(result.text)["a"] in ("x", "y")
    assert raw.startswith("<|channel|>analysis<|message|>")  # this model thinks first: four tokens, then `<|end|>`
    message, end = tokenizer.token_id("<|message|>"), tokenizer.token_id("<|end|>")
    body = ids[ids.index(message) + 1 : ids.index(end)]
    assert len(body) == 4 and result.reasoning == tokenizer.decode(body, skip_special_tokens=False)
    assert raw.endswith(f"<|channel|>final<|message|>{result.text}<|return|>")


def test_reasoning_effort_is_told_to_the_template(harmony: InferenceEngine) -> None:
    from serve_app.wire.model_card import ModelInfo

    info = ModelInfo("m", 2048, 0, "openai", harmony.vocab_size, harmony.hidden_size, reasoning_parser="openai_gptoss")
    request = ChatCompletionsBuilder().prepare(
        {"model": "m", "messages": MESSAGES, "reasoning_effort": "low"}, info
    ).prepared.requests[0]
    prompt = harmony.tokenizer.apply_chat_template(request.messages, template_kwargs=request.chat_template_kwargs)
    assert "Reasoning: low" in prompt and request.thinking_token_budget == 1024


def test_the_openai_sdk_gets_the_reasoning_apart_whole_and_streamed(harmony: InferenceEngine) -> None:
    fields = dict(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=60, extra_body={"thinking_token_budget": 4},
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
    )
    with engine_server(harmony) as server:
        client = openai_client(server.url)
        reply = client.chat.completions.create(**fields)
        streamed = {"reasoning_content": "", "content": ""}
        for chunk in client.chat.completions.create(**fields, stream=True):
            for key in streamed:
                streamed[key] += (getattr(chunk.choices[0].delta, key, None) or "") if chunk.choices else ""
    message = reply.choices[0].message
    assert json.loads(message.content)["a"] in ("x", "y") and message.reasoning_content  # type: ignore[attr-defined]
    assert streamed == {"reasoning_content": message.reasoning_content, "content": message.content}  # type: ignore[attr-defined]
    assert reply.usage.completion_tokens_details.reasoning_tokens > 4
