"""Prefix sharing through the engine, salts that never share, and a contiguous cache waiting for a slot
(preemption under memory pressure: tests/engine/test_speculation.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from serve_app import GenerateRequest, InferenceEngine
from serve_app.bench.idle import wait_idle
from tests.prompts import SYSTEM_PROMPT

NEW_TOKENS = 24


def _chat(engine: InferenceEngine, question: str) -> list[int]:
    return engine.tokenizer.encode_chat(
        [{"role": "system", "content": SYSTEM_PROMPT * 2}, {"role": "user", "content": question}]
    )


def _greedy(ids: list[int], salt: str = "", max_tokens: int = NEW_TOKENS) -> GenerateRequest:
    return GenerateRequest(prompt=ids, max_tokens=max_tokens, temperature=0, ignore_eos=True, client_salt=salt)


def test_prefix_hit_prefills_only_the_rest(engine: InferenceEngine) -> None:
    ids = _chat(engine, "Tell me about anchors.")
    cold = engine.submit(_greedy(ids, salt="prefix-test")).wait(60)
    before = engine.get_stats()
    warm = engine.submit(_greedy(ids, salt="prefix-test")).wait(60)
    after = engine.get_stats()
    expected_hit = ((len(ids) - 1) // 16) * 16
    assert cold.cached_tokens == 0
    assert warm.cached_tokens == expected_hit and expected_hit >= 96
    assert warm.usage.cached_tokens == expected_hit
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == expected_hit
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(ids) - expected_hit
    assert warm.token_ids == cold.token_ids


def test_different_salts_never_share(engine: InferenceEngine) -> None:
    ids = _chat(engine, "What is a compass?")
    engine.submit(_greedy(ids, salt="tenant-a")).wait(60)
    hits = engine.get_stats()["prefix_cache_hit_tokens"]
    other = engine.submit(_greedy(ids, salt="tenant-b")).wait(60)
    assert other.cached_tokens == 0
    assert engine.get_stats()["prefix_cache_hit_tokens"] == hits
    same = engine.submit(_greedy(ids, salt="tenant-a")).wait(60)
    assert same.cached_tokens > 0


def test_prompt_that_can_never_fit_is_rejected_at_submit(engine: InferenceEngine) -> None:
    too_long = [100] * engine.max_model_len
    with pytest.raises(ValueError, match="prompt"):
        engine.submit(GenerateRequest(prompt=too_long, max_tokens=1))
    assert engine.get_stats()["waiting_queue"] == 0


def test_contiguous_cache_waits_for_a_free_slot(model_path: Path, reference) -> None:
    eng = InferenceEngine(compile=False, model=str(model_path), kv_cache="contiguous", cache_tokens=2 * 256, max_model_len=256)
    try:
        assert eng.get_stats()["kv_pages_total"] == 2
        prompts = [eng.tokenizer.encode(f"Counting to {n}: one, two,") for n in range(5)]
        results = [eng.submit(_greedy(ids, max_tokens=12)) for ids in prompts]
        for ids, result in zip(prompts, results):
            assert result.wait(120).token_ids == reference.greedy(ids, 12)
        wait_idle(eng.get_stats)
    finally:
        eng.shutdown()
