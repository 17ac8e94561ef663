"""A reasoning model's thinking, apart from its answer: Qwen3's real template and tokens on a tiny random model,
with `reasoning_parser: qwen3` (and DeepSeek-R1's real template with `deepseek_r1`). The span's end is read by token id; a budget closes it; a grammar holds the answer
only; `enable_thinking: false` (the template closes the span in the prompt) leaves all of the output to the answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from serve_app.engine.engine import InferenceEngine
from serve_app.wire.refusals import InvalidRequestError
from serve_app.wire.requests import GenerateRequest, StructuredOutput
from tests.model_families import qwen3_tokenizer, template
from tests.tiny_models import build_tiny_model

THINK, END_THINK = 151667, 151668
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def plain(tiny_qwen3_thinker_path: Path) -> Iterator[InferenceEngine]:
    """The same model without a reasoning parser: the tokens to compare with."""
    engine = InferenceEngine(str(tiny_qwen3_thinker_path), compile=False, cache_tokens=4096)
    yield engine
    engine.shutdown()


def run(engine: InferenceEngine, **fields):
    return engine.submit(GenerateRequest(messages=MESSAGES, temperature=0, **fields)).wait(timeout=120)


def test_the_tokenizer_is_qwen3s(thinker: InferenceEngine) -> None:
    tokens = ["<think>", "</think>", "<|im_end|>"]
    assert [thinker.tokenizer.token_id(t) for t in tokens] == [THINK, END_THINK, 151645]
    prompt = thinker.tokenizer.apply_chat_template(MESSAGES, template_kwargs={"enable_thinking": False})
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_without_a_closing_tag_the_whole_output_is_thinking(thinker: InferenceEngine, plain: InferenceEngine) -> None:
    thought, reference = run(thinker, max_tokens=12), run(plain, max_tokens=12)
    assert thought.token_ids == reference.token_ids  # reading the span changes no token
    assert END_THINK not in thought.token_ids
    assert thought.text == "" and thought.reasoning == reference.text
    assert thought.usage.reasoning_tokens == 12


def test_a_budget_closes_the_span_and_the_rest_is_the_answer(thinker: InferenceEngine) -> None:
    tokenizer = thinker.tokenizer
    result = run(thinker, max_tokens=12, thinking_token_budget=5)
    ids = result.token_ids
    first = 1 if ids[0] == THINK else 0  # the model may write the opening tag itself
    assert ids[first + 5] == END_THINK and END_THINK not in ids[: first + 5]
    assert result.reasoning == tokenizer.decode(ids[first : first + 5])
    assert result.text == tokenizer.decode(ids[first + 6 :]) and result.text
    assert result.usage.reasoning_tokens == first + 6 and result.finish_reason == "length"


def test_a_budget_of_nothing_answers_at_once(thinker: InferenceEngine) -> None:
    result = run(thinker, max_tokens=6, thinking_token_budget=0)
    assert result.token_ids[0] == END_THINK and result.reasoning == ""
    assert result.text == thinker.tokenizer.decode(result.token_ids[1:])


def test_enable_thinking_false_leaves_the_output_to_the_answer(thinker: InferenceEngine, plain: InferenceEngine) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    result, reference = run(thinker, max_tokens=10, **off), run(plain, max_tokens=10, **off)
    assert result.reasoning == "" and result.text == reference.text and result.usage.reasoning_tokens == 0


def test_the_grammar_holds_the_answer_not_the_thinking(thinker: InferenceEngine) -> None:
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}
    result = run(thinker, max_tokens=40, thinking_token_budget=4, structured_output=StructuredOutput(json=schema))
    assert result.finish_reason == "stop"
    assert json.loads(result.text)["a"] in ("x", "y")
    assert result.reasoning and not result.reasoning.lstrip().startswith("{")  # the thinking was free text


def test_allowed_token_ids_keep_the_span_closable(thinker: InferenceEngine) -> None:
    words = thinker.tokenizer.encode(" yes no")
    result = run(thinker, max_tokens=8, thinking_token_budget=3, allowed_token_ids=words)
    assert END_THINK in result.token_ids and set(result.token_ids) <= {*words, THINK, END_THINK}


def test_an_engine_without_a_parser_refuses_a_thinking_budget(plain: InferenceEngine) -> None:
    with pytest.raises(InvalidRequestError, match="thinking_token_budget"):
        plain.submit(GenerateRequest(messages=MESSAGES, thinking_token_budget=10))


def test_deepseek_r1s_template_opens_the_span_in_the_prompt(tmp_path: Path) -> None:
    """DeepSeek-R1's real template (its distilled Qwen's) writes `<think>\\n` into the prompt itself: the output starts
    inside the span, which `deepseek_r1` reads the same way; `enable_thinking` unset, the template closes it there."""
    folder = build_tiny_model(
        "qwen3", tmp_path / "r1", tokenizer_from=qwen3_tokenizer(), chat_template=template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"),
        vocab_size=151936, bos_token_id=None, eos_token_id=151645, pad_token_id=151643,
    )
    engine = InferenceEngine(str(folder), compile=False, reasoning_parser="deepseek_r1", cache_tokens=4096)
    try:
        thinking = {"chat_template_kwargs": {"enable_thinking": True}}
        assert engine.tokenizer.apply_chat_template(MESSAGES, template_kwargs=thinking["chat_template_kwargs"]).endswith("<think>\n")
        result = run(engine, max_tokens=8, thinking_token_budget=3, **thinking)
        assert result.token_ids[3] == END_THINK and result.reasoning == engine.tokenizer.decode(result.token_ids[:3])
        assert result.text == engine.tokenizer.decode(result.token_ids[4:])
        closed = run(engine, max_tokens=4)
        assert closed.reasoning == "" and closed.text == engine.tokenizer.decode(closed.token_ids)
    finally:
        engine.shutdown()
