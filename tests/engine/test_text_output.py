"""Text out: stop strings are cut and never emitted; streamed UTF-8 is never split."""

from __future__ import annotations

from pathlib import Path

from serve_app import GenerateRequest, InferenceEngine
from serve_app.engine.stopping import StopStringMatcher
from serve_app.model.detokenizer import IncrementalDetokenizer
from serve_app.model.tokenizer import Tokenizer


def test_stop_matcher_holds_back_a_possible_stop_and_cuts_at_the_match() -> None:
    matcher = StopStringMatcher(["END", "\n\n"])
    assert matcher.feed("hello E") == "hello "
    assert matcher.feed("N") == ""
    assert matcher.feed("X more") == "ENX more"
    assert matcher.feed(" tail\n") == " tail"
    assert matcher.feed("\nignored") == ""
    assert matcher.matched == "\n\n"


def test_stop_matcher_earliest_stop_wins_and_flush_returns_the_hold() -> None:
    matcher = StopStringMatcher(["cd", "abc"])
    assert matcher.feed("xxabcd") == "xx" and matcher.matched == "abc"
    other = StopStringMatcher(["stop"])
    assert other.feed("no st") == "no " and other.flush() == "st"


def test_detokenizer_never_splits_multibyte_characters(model_path: Path) -> None:
    tokenizer = Tokenizer(model_path)
    text = "日本語のテキスト 🙂 café, naïve — ½ ∑"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt:"))
    deltas = [detok.push(i) for i in ids]
    assert any(d == "" for d in deltas), "some tokens carry only part of a character"
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == tokenizer.decode(ids)


def test_stop_string_cuts_the_text_and_is_not_emitted(engine: InferenceEngine) -> None:
    prompt = "List the days of the week: Monday, Tuesday,"
    full = engine.generate(prompt, max_tokens=24, temperature=0)
    words = [w for w in full.split() if len(w) > 3]
    stop = words[len(words) // 2]
    expected = full[: full.index(stop)]
    result = engine.submit(GenerateRequest(prompt=prompt, max_tokens=24, temperature=0, stop=[stop])).wait(60)
    assert result.text == expected and result.finish_reason == "stop"
    streamed = list(engine.generate(prompt, stream=True, max_tokens=24, temperature=0, stop=stop))
    assert "".join(streamed) == expected
    assert all(stop not in delta for delta in streamed)


def test_stop_token_ids_and_eos_end_generation(engine: InferenceEngine) -> None:
    prompt = "Count: 1, 2, 3,"
    free_run = engine.submit(GenerateRequest(prompt=prompt, max_tokens=10, temperature=0, ignore_eos=True)).wait(60)
    stop_id = free_run.token_ids[3]
    stopped = engine.submit(
        GenerateRequest(prompt=prompt, max_tokens=10, temperature=0, stop_token_ids=[stop_id])
    ).wait(60)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free_run.token_ids[: free_run.token_ids.index(stop_id) + 1]
    chat = GenerateRequest(messages=[{"role": "user", "content": "Say OK."}], max_tokens=200, temperature=0)
    answer = engine.submit(chat).wait(120)
    assert answer.finish_reason == "stop" and answer.token_ids[-1] in engine.tokenizer.eos_token_ids
    assert "<|im_end|>" not in answer.text
