"""Speculative decoding (`speculative_config: {method: ngram}`): greedy tokens identical to decoding without it,
rejection sampling that keeps the target distribution, and composition with grammars, stop strings, logprobs,
prefix caching, preemption and the compiled forward."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from serve_app import GenerateRequest, InferenceEngine
from serve_app.bench.idle import wait_idle
from serve_app.bench.prompts import grounded_chats
from serve_app.config import EngineConfig
from serve_app.engine.sampling import SamplingBatch, SamplingPipeline
from serve_app.engine.speculation import REMEASURE_AFTER, NgramIndex, StepTimes
from serve_app.kv.view import BatchEntry, KVCacheView
from serve_app.model.attention import step_context
from serve_app.model.runner import ForwardBatch
from serve_app.wire.requests import SamplingParams, StructuredOutput
from tests.inprocess import MODEL, engine_server, openai_client
from tests.prompts import oracle_prompts
from tests.references import ReferenceModel
from tests.served import metric_samples

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def speculating(model_path: Path) -> Iterator[InferenceEngine]:
    eng = InferenceEngine(
        compile=False,
        model=str(model_path), page_size=16, cache_tokens=8192, max_model_len=2048, speculative_config=NGRAM
    )
    yield eng
    eng.shutdown()


def _greedy(ids: list[int], max_tokens: int = NEW_TOKENS, **extra) -> GenerateRequest:
    return GenerateRequest(prompt=ids, max_tokens=max_tokens, temperature=0, ignore_eos=True, **extra)


def _spec(engine: InferenceEngine) -> dict[str, int]:
    return {k.removeprefix("spec_decode_"): v for k, v in engine.get_stats().items() if k.startswith("spec_decode_")}


def test_ngram_index_proposes_what_followed_the_longest_earlier_match() -> None:
    index = NgramIndex(2, 3)
    assert index.propose([1, 2, 3, 4, 5, 9, 2, 3], 3) == [4, 5, 9]  # "2 3" seen before: what came after it
    assert index.propose([1, 2, 3, 4, 5, 9, 2, 3, 4], 2) == [5, 9]  # "2 3 4", the longer match, wins
    assert NgramIndex(2, 3).propose([1, 2, 3, 4], 3) == []  # nothing repeats
    latest = NgramIndex(2, 2)  # of several earlier occurrences, the latest
    assert latest.propose([7, 8, 1, 7, 8, 2, 7, 8], 1) == [2]


def test_a_step_size_measured_slow_once_is_measured_again() -> None:
    """A one-off slow step (a first run's one-time costs, a busy host) must not keep the proposals of that
    size from ever running again: the size's first steps are averaged alike, and a size not run for a
    while is forgotten, so it is estimated from its neighbours and tried."""
    times = StepTimes()
    times.record(1, 0.040)
    times.record(5, 0.400)  # its first step paid for something else
    assert times.estimate(5) == pytest.approx(0.400)
    times.record(5, 0.050)
    assert times.estimate(5) == pytest.approx(0.225)  # the second step counts as much as the first
    for _ in range(REMEASURE_AFTER):
        times.record(1, 0.040)
    assert times.estimate(5) == pytest.approx(0.040 * (1 + 0.1 * 4))  # forgotten: optimistic again
    assert times.estimate(1) == pytest.approx(0.040)


@pytest.mark.parametrize("draft_index", [0, 3, 5])
def test_rejection_sampling_keeps_the_target_distribution(draft_index: int) -> None:
    """Whatever token is proposed (likely or not), the tokens drawn follow the row's distribution:
    chi-square over 8 tokens (7 degrees of freedom) under its 0.1% critical value, 24.32."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3]])
    params = SamplingParams(temperature=0.8, top_k=0)
    target = (logits / 0.8).softmax(dim=1)[0]
    generator = torch.Generator().manual_seed(1234)
    batch = SamplingBatch.build([params], torch.device("cpu"), generators=[generator])
    draws = 20000
    counts = torch.zeros(8)
    for _ in range(draws):
        counts[int(SamplingPipeline()(logits, batch, [draft_index])[0])] += 1
    expected = target * draws
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 24.32, (chi_square, counts.tolist(), expected.tolist())


def test_greedy_tokens_equal_transformers_alone_and_in_a_mixed_batch(
    speculating: InferenceEngine, reference: ReferenceModel, model_path: Path
) -> None:
    tokenizer = speculating.tokenizer
    repeating = [tokenizer.encode_chat(chat) for chat in grounded_chats(3, seed=3)]
    plain = oracle_prompts(tokenizer)[:3]
    before = _spec(speculating)
    alone = speculating.submit(_greedy(repeating[0])).wait(120).token_ids
    assert alone == reference.greedy(repeating[0], NEW_TOKENS)
    mixed = repeating + plain  # together: speculating rows beside rows that find nothing to propose
    results = [speculating.submit(_greedy(ids)) for ids in mixed]
    for ids, result in zip(mixed, [r.wait(180) for r in results]):
        assert result.token_ids == reference.greedy(ids, NEW_TOKENS)
        assert result.finish_reason == "length" and len(result.token_ids) == NEW_TOKENS
    after = _spec(speculating)
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    assert accepted > NEW_TOKENS  # the repeating prompts did run ahead
    assert after["emitted_tokens"] - before["emitted_tokens"] == accepted + after["drafts"] - before["drafts"]
    wait_idle(speculating.get_stats)


def test_stop_strings_max_tokens_and_logprobs_as_without_speculation(
    speculating: InferenceEngine, engine: InferenceEngine
) -> None:
    ids = speculating.tokenizer.encode_chat(grounded_chats(1, seed=5)[0])
    plain = engine.submit(_greedy(ids, 30, logprobs=2)).wait(120)
    stop = plain.text[len(plain.text) // 2 :][:6]
    for request in (_greedy(ids, 30, logprobs=2), _greedy(ids, 7), _greedy(ids, 30, stop=[stop])):
        ours, theirs = speculating.submit(request).wait(120), engine.submit(request).wait(120)
        assert (ours.token_ids, ours.text, ours.finish_reason) == (theirs.token_ids, theirs.text, theirs.finish_reason)
        assert len(ours.logprobs) == len(theirs.logprobs)
        for mine, other in zip(ours.logprobs, theirs.logprobs):
            assert mine.token_id == other.token_id and [t for t, _, _ in mine.top] == [t for t, _, _ in other.top]
            assert mine.logprob == pytest.approx(other.logprob, abs=1e-3)
    assert speculating.submit(_greedy(ids, 30, stop=[stop])).wait(120).stop_string == stop


@pytest.fixture
def fresh_speculating(model_path: Path) -> Iterator[InferenceEngine]:
    """A speculating engine of its own: it verifies proposals at step sizes it has not measured yet, so
    whether a test's proposals run does not hang on the step times earlier tests left behind."""
    eng = InferenceEngine(
        compile=False,
        model=str(model_path), page_size=16, cache_tokens=4096, max_model_len=1024, speculative_config=NGRAM
    )
    yield eng
    eng.shutdown()


def test_constrained_outputs_stay_in_their_grammar_and_equal_unspeculated_ones(
    fresh_speculating: InferenceEngine, engine: InferenceEngine
) -> None:
    speculating = fresh_speculating
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
              "age": {"type": "integer"}}, "required": ["name", "city", "age"]}
    chat = [{"role": "user", "content": 'Return this JSON unchanged: {"name": "Ada", "city": "Oslo", "age": 36}'}]
    request = GenerateRequest(messages=chat, max_tokens=60, temperature=0, structured_output=StructuredOutput(json=schema))
    before = _spec(speculating)["accepted_tokens"]
    ours, theirs = speculating.submit(request).wait(120), engine.submit(request).wait(120)
    assert ours.token_ids == theirs.token_ids and set(json.loads(ours.text)) == {"name", "city", "age"}
    assert _spec(speculating)["accepted_tokens"] > before
    # Rejection sampling under a grammar emits only what the grammar allows (unseeded: a seeded request
    # takes no proposals).
    drafts = _spec(speculating)["drafts"]
    sampled = speculating.submit(request.model_copy(update={"temperature": 0.7})).wait(120)
    assert _spec(speculating)["drafts"] > drafts
    json.loads(sampled.text)


def test_streamed_chat_through_the_openai_sdk_and_the_metrics(speculating: InferenceEngine) -> None:
    """Several tokens a step reach a streaming client as they come, whole; /metrics counts the proposals."""
    chat = grounded_chats(1, seed=6)[0]
    with engine_server(speculating) as server:
        client = openai_client(server.url)
        whole = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=40, temperature=0)
        stream = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=40, temperature=0, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        samples = metric_samples(server.url)
    proposed = samples.total("serve_app:spec_decode_num_draft_tokens_total")
    accepted = samples.total("serve_app:spec_decode_num_accepted_tokens_total")
    assert proposed >= accepted > 0
    assert samples.total("serve_app:spec_decode_acceptance_rate") == pytest.approx(accepted / proposed)


def test_seeded_sampling_repeats_itself(speculating: InferenceEngine) -> None:
    ids = speculating.tokenizer.encode_chat(grounded_chats(1, seed=9)[0])
    request = GenerateRequest(prompt=ids, max_tokens=24, temperature=0.7, seed=11, ignore_eos=True)
    drafts = _spec(speculating)["drafts"]
    first, second = speculating.submit(request).wait(120), speculating.submit(request).wait(120)
    assert first.token_ids == second.token_ids and len(first.token_ids) == 24
    # Which proposals a step keeps follows measured step times, so a seeded request takes none.
    assert _spec(speculating)["drafts"] == drafts


def test_batches_over_the_limit_back_off_and_preemption_keeps_greedy_tokens(
    model_path: Path, reference: ReferenceModel
) -> None:
    """A cache too small for six repeating requests: they preempt each other (the engine's preemption test:
    recompute gives the unpressured tokens), two or more at a time back off from speculating
    (disable_by_batch_size 1), and every one still gives transformers' tokens."""
    eng = InferenceEngine(
        compile=False,
        model=str(model_path), page_size=16, cache_tokens=16 * 14, max_model_len=224, max_num_batched_tokens=64,
        max_num_seqs=6, speculative_config={**NGRAM, "disable_by_batch_size": 1},
    )
    try:
        prompts = [eng.tokenizer.encode_chat(chat) for chat in grounded_chats(6, seed=7)]
        results = [eng.submit(_greedy(ids, 48)) for ids in prompts]
        for ids, result in zip(prompts, [r.wait(300) for r in results]):
            assert result.token_ids == reference.greedy(ids, 48)
            assert result.finish_reason == "length"
        stats = eng.get_stats()
        assert stats["preemptions"] > 0 and stats["spec_decode_backed_off_rows"] > 0
        assert stats["spec_decode_accepted_tokens"] > 0  # alone, they did speculate
        wait_idle(eng.get_stats)
    finally:
        eng.shutdown()


@torch.inference_mode()
def _logits(engine: InferenceEngine, entry: BatchEntry, ids: list[int], pages: list[int], kernel: bool) -> torch.Tensor:
    """The logits of every row of a one-entry step (its k/v written into `pages`)."""
    view = KVCacheView(engine.cache.storage, [entry], [pages])
    batch = ForwardBatch([entry], ids, list(range(entry.num_new)), [None])
    with step_context(view, engine.runner.decode_kernel if kernel else None):
        out = engine.runner.model(
            input_ids=torch.tensor([ids]), position_ids=torch.tensor([list(range(entry.start, entry.end))]),
            use_cache=False, logits_to_keep=torch.tensor(batch.sample_rows),
        )
    return out.logits[0]


@pytest.mark.parametrize("kernel", [True, False], ids=["decode-kernel", "torch-decode"])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_verifying_row_gives_the_logits_of_its_tokens_prefilled(arch: str, kernel: bool, request) -> None:
    """A decode token and four proposals, attended as decode rows over the cached context, give the same
    logits as prefilling the whole sequence: each row sees exactly the tokens before it."""
    path: Path = request.getfixturevalue(f"tiny_{arch}_path")
    eng = InferenceEngine(compile=False, model=str(path), page_size=8, cache_tokens=1024, max_model_len=256)
    try:
        ids = torch.randint(0, eng.runner.vocab_size, (45,), generator=torch.Generator().manual_seed(2)).tolist()
        _logits(eng, BatchEntry(1, 0, 40), ids[:40], list(range(6)), kernel)  # the context, cached in pages 0-5
        verified = _logits(eng, BatchEntry(1, 40, 5, verifies=True), ids[40:], list(range(6)), kernel)
        prefilled = _logits(eng, BatchEntry(2, 0, 45), ids, list(range(10, 16)), kernel)[40:]
        torch.testing.assert_close(verified, prefilled, rtol=1e-4, atol=1e-4)
    finally:
        eng.shutdown()


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"method": "eagle"}, "method"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "draft_model": "x"}, "draft_model"),
    ],
)
def test_a_bad_speculative_config_is_refused_naming_its_field(config: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        EngineConfig.from_options(speculative_config=config)
