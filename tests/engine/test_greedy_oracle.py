"""The correctness oracle: greedy tokens equal transformers' `generate(do_sample=False)`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from serve_app import GenerateRequest, InferenceEngine
from serve_app.bench.idle import wait_idle
from tests.prompts import SYSTEM_PROMPT, oracle_prompts

NEW_TOKENS = 32

CACHES = {
    "contiguous": dict(kv_cache="contiguous", cache_tokens=8 * 1024, max_model_len=1024),
    "paged-16": dict(kv_cache="paged", page_size=16, cache_tokens=8192, max_model_len=2048),
    "paged-7": dict(kv_cache="paged", page_size=7, cache_tokens=8190, max_model_len=2048),
    "paged-16-torch-decode": dict(
        kv_cache="paged", page_size=16, cache_tokens=8192, max_model_len=2048, decode_attention="torch"
    ),
}


@pytest.fixture(scope="module", params=list(CACHES))
def oracle_engine(request: pytest.FixtureRequest, model_path: Path) -> Iterator[InferenceEngine]:
    eng = InferenceEngine(compile=False, model=str(model_path), max_num_batched_tokens=256, **CACHES[request.param])
    # The paged decode kernel runs wherever it is not turned off (this CPU, float32, a C compiler).
    assert (eng.runner.decode_kernel is None) == request.param.endswith("torch-decode")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def prompts(model_path: Path) -> list[list[int]]:
    from serve_app.model.tokenizer import Tokenizer

    return oracle_prompts(Tokenizer(model_path))


def _greedy(ids: list[int]) -> GenerateRequest:
    return GenerateRequest(prompt=ids, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def test_prompt_set_spans_short_and_long(prompts: list[list[int]]) -> None:
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 8
    assert 10 <= lengths[0] <= 20 and 280 <= lengths[-1] <= 330, lengths


def test_batch_submitted_together(oracle_engine: InferenceEngine, reference, prompts) -> None:
    results = [oracle_engine.submit(_greedy(ids)) for ids in prompts]
    for ids, result in zip(prompts, [r.wait(120) for r in results]):
        assert result.token_ids == reference.greedy(ids, NEW_TOKENS)
        assert result.finish_reason == "length"
    wait_idle(oracle_engine.get_stats)


def test_batch_staggered(oracle_engine: InferenceEngine, reference, prompts) -> None:
    """Each request joins while the earlier ones are mid-decode."""
    results = []
    for ids in prompts:
        tokens: list[int] = []
        results.append(oracle_engine.submit(_greedy(ids), lambda delta, tokens=tokens: tokens.extend(delta.token_ids)))
        deadline = time.monotonic() + 60
        while len(tokens) < 3 and not results[-1].finished and time.monotonic() < deadline:
            time.sleep(0.005)
    for ids, result in zip(prompts, results):
        assert result.wait(120).token_ids == reference.greedy(ids, NEW_TOKENS)
    wait_idle(oracle_engine.get_stats)


def test_prefix_cache_hit_keeps_tokens(oracle_engine: InferenceEngine, reference, model_path: Path) -> None:
    """Two chats share a long system prompt; the second one's tokens are still transformers'."""
    tok = oracle_engine.tokenizer
    first = tok.encode_chat([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Who built ships?"}])
    second = tok.encode_chat([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "What is a harbour?"}])
    hits_before = oracle_engine.get_stats()["prefix_cache_hit_tokens"]
    a = oracle_engine.submit(_greedy(first)).wait(120)
    b = oracle_engine.submit(_greedy(second)).wait(120)
    assert a.token_ids == reference.greedy(first, NEW_TOKENS)
    assert b.token_ids == reference.greedy(second, NEW_TOKENS)
    hits = oracle_engine.get_stats()["prefix_cache_hit_tokens"] - hits_before
    if oracle_engine.config.cache.kind == "paged":
        page = oracle_engine.config.cache.page_size
        shared = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
        # The first request may itself hit pages left by earlier tests, so count only the second's.
        assert b.cached_tokens == (shared // page) * page > 0
        assert hits >= b.cached_tokens
    else:
        assert hits == 0 and b.cached_tokens == 0
