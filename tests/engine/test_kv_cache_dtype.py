"""A 16-bit KV cache (`kv_cache_dtype: bfloat16 | float16`) under a float32 model: twice the tokens in the same
bytes, k and v rounded as stored and widened as read (by the decode kernel and by the torch path alike), the
KV SDK describing the cache as it is, and greedy tokens that stay with fp32's on the standard prompts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from serve_app import GenerateRequest, InferenceEngine
from serve_app.bench.quant_bench import greedy_agreement
from serve_app.config import EngineConfig
from serve_app.wire.calls import KVConfig
from tests.prompts import oracle_prompts
from tests.references import ReferenceModel

NEW_TOKENS = 24
CACHE_BYTES = 64 * 2**20


# Each element type once, one read by the decode kernel, the other by the torch path (gather + SDPA).
@pytest.fixture(scope="module", params=[("bfloat16", "auto"), ("float16", "torch")], ids=["bfloat16", "float16-torch"])
def half_kv(request: pytest.FixtureRequest, model_path: Path) -> Iterator[InferenceEngine]:
    dtype, decode_attention = request.param
    eng = InferenceEngine(
        compile=False, model=str(model_path), kv_cache_dtype=dtype, decode_attention=decode_attention,
        cache_bytes=CACHE_BYTES, max_model_len=2048,
    )
    yield eng
    eng.shutdown()


def test_the_cache_holds_twice_the_tokens_in_its_bytes(half_kv: InferenceEngine, engine: InferenceEngine) -> None:
    storage = half_kv.cache.storage
    assert storage.k.dtype == storage.v.dtype == getattr(torch, half_kv.config.cache.kv_cache_dtype)
    assert half_kv.runner.dtype == torch.float32  # the model stays float32
    assert half_kv.runner.kv_shape.bytes_per_token * 2 == engine.runner.kv_shape.bytes_per_token
    pages = CACHE_BYTES // half_kv.runner.kv_shape.bytes_per_token // storage.page_size
    assert storage.n_pages == pages and storage.k.numel() * 2 * storage.k.element_size() <= CACHE_BYTES
    # The decode kernel reads 16-bit pages in place, as it reads float32 ones.
    assert (half_kv.runner.decode_kernel is not None) == (half_kv.config.model.decode_attention == "auto")


def test_the_kv_sdk_describes_the_cache_in_its_dtype(half_kv: InferenceEngine) -> None:
    described: KVConfig = half_kv.kv.config()
    assert described.dtype == half_kv.config.cache.kv_cache_dtype


def test_greedy_tokens_stay_with_fp32_on_the_standard_prompts(half_kv: InferenceEngine, reference: ReferenceModel) -> None:
    """Rounding k and v to 16 bits moves the logits by little: on these prompts the greedy tokens equal fp32's
    (transformers') for most of their length, the torch path's and the kernel's the same."""
    prompts = oracle_prompts(half_kv.tokenizer)
    results = [half_kv.submit(GenerateRequest(prompt=p, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
               for p in prompts]
    measured = greedy_agreement(
        half_kv.config.cache.kv_cache_dtype, [reference.greedy(p, NEW_TOKENS) for p in prompts],
        [r.wait(180).token_ids for r in results],
    )
    assert measured.prompts == len(prompts)
    assert measured.tokens_before_divergence >= 0.9, measured


def test_greedy_agreement_counts_the_tokens_before_the_first_that_differs() -> None:
    measured = greedy_agreement("bfloat16", [[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert (measured.prompts, measured.identical, measured.tokens_before_divergence) == (2, 1, 0.75)


def test_an_unknown_kv_cache_dtype_is_refused_naming_it() -> None:
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        EngineConfig.from_options(kv_cache_dtype="fp8")
