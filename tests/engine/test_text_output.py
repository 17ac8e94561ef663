"""Text out: stop strings are cut (and kept only where asked); streamed UTF-8 is never split; special tokens
shown where asked; a suffix asks for the middle in the model's fill-in-the-middle tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from serve_app import GenerateRequest, InferenceEngine
from serve_app.engine.stop_strings import StopStringMatcher
from serve_app.model.detokenizer import IncrementalDetokenizer
from serve_app.model.tokenizer import Tokenizer
from serve_app.wire.refusals import RequestRefused


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


def test_stop_matcher_can_keep_the_stop_and_let_text_pass_unmatched() -> None:
    kept = StopStringMatcher(["END"], include_stop=True)
    assert kept.feed("abcE") == "abc" and kept.feed("ND tail") == "END" and kept.matched == "END"
    early = StopStringMatcher(["END"])
    assert early.feed("xE") == "x" and early.pass_through("ND") == "END" and early.matched is None
    assert early.feed(" END") == " " and early.matched == "END"


def test_detokenizer_keeps_special_tokens_when_asked(model_path: Path) -> None:
    tokenizer = Tokenizer(model_path)
    end = next(iter(tokenizer.eos_token_ids))
    ids = [*tokenizer.encode("Hi"), end]
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    skipped = IncrementalDetokenizer(tokenizer)
    shown = "".join(kept.push(i) for i in ids) + kept.flush()
    assert shown == tokenizer.decode(ids, skip_special_tokens=False) and shown.endswith(tokenizer.decode([end], skip_special_tokens=False))
    assert "".join(skipped.push(i) for i in ids) + skipped.flush() == "Hi"


def test_suffix_asks_for_the_middle_in_the_models_fim_tokens(model_path: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_path)
    hf.add_special_tokens({"additional_special_tokens": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]})
    hf.save_pretrained(tmp_path)
    tokenizer = Tokenizer(tmp_path)
    ids = tokenizer.prompt_ids(GenerateRequest(prompt="def f(", suffix="return x"))
    fim = [tokenizer.token_id(t) for t in ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")]
    assert ids[0] == fim[0] and ids[-1] == fim[2] and fim[1] in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "def f(return x"
    with pytest.raises(RequestRefused, match="fill-in-the-middle"):
        Tokenizer(model_path).prompt_ids(GenerateRequest(prompt="def f(", suffix="x"))


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
