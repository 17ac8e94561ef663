"""The engine's cached-KV API: lookup, retrieve, store, against transformers and its own generation."""

from __future__ import annotations

import pytest
import torch

from serve_app.engine.engine import InferenceEngine
from serve_app.kvsdk import rerotate_k
from serve_app.wire.requests import GenerateRequest
from tests.prompts import _PASSAGE
from tests.references import ReferenceModel

PAGE = 16


@pytest.fixture(scope="module")
def prompt(engine: InferenceEngine) -> list[int]:
    ids = engine.tokenizer.encode(_PASSAGE * 2 + "The keeper")
    assert len(ids) % PAGE != 0 and len(ids) > 6 * PAGE
    return ids


def greedy(engine: InferenceEngine, ids: list[int], salt: str, max_tokens: int = 12) -> list[int]:
    result = engine.submit(
        GenerateRequest(prompt=ids, max_tokens=max_tokens, temperature=0, ignore_eos=True, client_salt=salt)
    )
    return list(result.wait(60).token_ids)


def test_config_describes_the_cache(engine: InferenceEngine) -> None:
    config = engine.kv.config()
    shape = engine.runner.kv_shape
    assert (config.page_size, config.n_layers, config.n_kv_heads, config.head_dim) == (
        PAGE, shape.n_layers, shape.n_kv_heads, shape.head_dim,
    )
    assert config.dtype == "float32" and config.rotary_dim == shape.head_dim
    assert len(config.rope_inv_freq) == shape.head_dim // 2 and config.rope_inv_freq[0] == pytest.approx(1.0)


def test_retrieved_kv_equals_transformers(engine: InferenceEngine, reference: ReferenceModel, prompt: list[int]) -> None:
    greedy(engine, prompt, "retrieve", max_tokens=1)
    cached = len(prompt) // PAGE * PAGE
    assert engine.kv.lookup(prompt, "retrieve") == cached
    kv = engine.kv.retrieve(prompt, "retrieve")
    shape = engine.runner.kv_shape
    assert kv is not None and kv.device.type == "cpu"
    assert kv.shape == (2, shape.n_layers, cached, shape.n_kv_heads * shape.head_dim)
    torch.testing.assert_close(kv, reference.kv(prompt[:cached]), atol=2e-4, rtol=1e-4)


def test_nothing_cached_under_another_salt_or_under_a_page(engine: InferenceEngine, prompt: list[int]) -> None:
    greedy(engine, prompt, "seen", max_tokens=1)
    assert engine.kv.lookup(prompt, "never-used") == 0
    assert engine.kv.retrieve(prompt, "never-used") is None
    assert engine.kv.retrieve(prompt[: PAGE - 1], "seen") is None


def test_round_trip_to_another_salt_is_all_hits_and_greedy_equal(
    engine: InferenceEngine, reference: ReferenceModel, prompt: list[int]
) -> None:
    expected = greedy(engine, prompt, "A")
    assert expected == reference.greedy(prompt, 12)
    kv = engine.kv.retrieve(prompt, "A")
    assert kv is not None
    stored = kv.shape[2]
    assert engine.kv.store(kv, prompt[:stored], "B") is True
    before = engine.get_stats()
    assert greedy(engine, prompt, "B") == expected
    after = engine.get_stats()
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == stored
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(prompt) - stored


def test_stored_kv_is_used_instead_of_prefill(engine: InferenceEngine, prompt: list[int]) -> None:
    expected = greedy(engine, prompt, "real")
    kv = engine.kv.retrieve(prompt, "real")
    assert kv is not None
    stored = kv.shape[2]
    altered = kv.clone()
    altered[1] = torch.flip(altered[1], dims=[1])  # every layer's values in reverse token order
    assert engine.kv.store(altered, prompt[:stored], "altered")
    before = engine.get_stats()
    assert greedy(engine, prompt, "altered") != expected
    after = engine.get_stats()
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(prompt) - stored


def test_store_deduplicates_and_checks_its_input(engine: InferenceEngine, prompt: list[int]) -> None:
    greedy(engine, prompt, "dedup", max_tokens=1)
    kv = engine.kv.retrieve(prompt, "dedup")
    assert kv is not None
    stored = kv.shape[2]
    assert engine.kv.store(kv, prompt[:stored], "dedup") is False
    result = engine.kv.store_pages(kv, prompt[:stored], "dedup")
    assert (result.stored_pages, result.deduplicated_pages) == (0, stored // PAGE)
    # A partial page at the end is cut off, not stored.
    assert engine.kv.store_pages(kv[:, :, : PAGE + 3], prompt[: PAGE + 3], "partial").stored_pages == 1
    assert engine.kv.lookup(prompt, "partial") == PAGE
    with pytest.raises(ValueError, match="tokens: .* tokens for KV of"):
        engine.kv.store(kv, prompt[: stored - 1], "x")
    with pytest.raises(ValueError, match="kv: shape"):
        engine.kv.store(kv[:, 1:], prompt[:stored], "x")
    with pytest.raises(ValueError, match="kv: shape"):
        engine.kv.store(kv[0], prompt[:stored], "x")
    with pytest.raises(ValueError, match="kv: dtype float16"):
        engine.kv.store(kv.half(), prompt[:stored], "x")
    with pytest.raises(ValueError, match="tokens: token id"):
        engine.kv.store(kv, [10**9] * stored, "x")


def test_rerotate_k_moves_layer_zero_keys_to_new_positions(engine: InferenceEngine, reference: ReferenceModel) -> None:
    # Layer 0's k depends only on each token and its position, so a shifted run is a rotation away.
    config = engine.kv.config()
    body = engine.tokenizer.encode(" the keeper climbed the stairs to light the lamp")
    lead = engine.tokenizer.encode("At night")
    alone = reference.kv(body)
    shifted = reference.kv(lead + body)[:, :, len(lead) :]
    moved = rerotate_k(alone, range(len(body)), range(len(lead), len(lead) + len(body)), config)
    torch.testing.assert_close(moved[0, 0], shifted[0, 0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(moved[1], alone[1])
    back = rerotate_k(moved, range(len(lead), len(lead) + len(body)), range(len(body)), config)
    torch.testing.assert_close(back, alone, atol=1e-5, rtol=1e-5)


def test_contiguous_cache_refuses_kv_calls(tiny_llama_path) -> None:
    engine = InferenceEngine(compile=False, model=str(tiny_llama_path), kv_cache="contiguous", cache_tokens=1024, max_model_len=256)
    try:
        with pytest.raises(ValueError, match="kv_cache: .*paged"):
            engine.kv.lookup([1, 2, 3])
    finally:
        engine.shutdown()
