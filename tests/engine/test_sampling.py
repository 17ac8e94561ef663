"""Sampling: the strategies on known logits, and seeded, top-k and greedy behaviour through the engine."""

from __future__ import annotations

import pytest
import torch

from serve_app import GenerateRequest, InferenceEngine
from serve_app.engine.sampling import (
    MinPStrategy,
    PenaltyStrategy,
    SamplingBatch,
    SamplingPipeline,
    TemperatureStrategy,
    TopKStrategy,
    TopPStrategy,
    sample,
)
from serve_app.wire.requests import SamplingParams

CPU = torch.device("cpu")
LOGITS = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))


def _batch(**params) -> SamplingBatch:
    return SamplingBatch.build([SamplingParams(**params)], CPU)


def _kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_defaults() -> None:
    params = SamplingParams()
    assert (params.temperature, params.top_k, params.top_p) == (1.0, 50, 1.0)
    assert not params.is_greedy and SamplingParams(temperature=0).is_greedy


def test_top_k_keeps_k_largest_and_zero_or_minus_one_disables() -> None:
    assert _kept(TopKStrategy().apply(LOGITS, _batch(top_k=2))) == [0, 1]
    for off in (0, -1):
        batch = _batch(top_k=off)
        assert not TopKStrategy().applies(batch)


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    assert _kept(TopPStrategy().apply(LOGITS, _batch(top_p=0.6))) == [0, 1]
    assert _kept(TopPStrategy().apply(LOGITS, _batch(top_p=0.7))) == [0, 1]
    assert _kept(TopPStrategy().apply(LOGITS, _batch(top_p=0.71))) == [0, 1, 2]
    assert _kept(TopPStrategy().apply(LOGITS, _batch(top_p=0.1))) == [0]


def test_min_p_drops_tokens_under_a_fraction_of_the_top() -> None:
    assert _kept(MinPStrategy().apply(LOGITS, _batch(min_p=0.3))) == [0, 1, 2]


def test_temperature_sharpens_and_flattens() -> None:
    cold = TemperatureStrategy().apply(LOGITS, _batch(temperature=0.5)).softmax(1)
    hot = TemperatureStrategy().apply(LOGITS, _batch(temperature=2.0)).softmax(1)
    base = LOGITS.softmax(1)
    assert cold[0, 0] > base[0, 0] > hot[0, 0]


def test_penalties_follow_their_definitions() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    rep = SamplingBatch.build([SamplingParams(repetition_penalty=2.0)], CPU, prompt_ids=[[0]], output_ids=[[1]])
    out = PenaltyStrategy().apply(logits, rep)
    assert out.tolist() == [[1.0, -2.0, 0.5, 1.0]]
    freq = SamplingBatch.build(
        [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)], CPU, prompt_ids=[[3]], output_ids=[[2, 2, 0]]
    )
    out = PenaltyStrategy().apply(logits, freq)
    assert out.tolist() == [[2.0 - 0.75, -1.0, 0.5 - 1.0, 1.0]]


def test_pipeline_greedy_rows_take_the_argmax_and_sampled_rows_stay_in_the_top_k() -> None:
    logits = torch.randn(6, 100)
    params = [SamplingParams(temperature=0)] * 3 + [SamplingParams(top_k=3)] * 3
    batch = SamplingBatch.build(params, CPU)
    for _ in range(20):
        tokens = SamplingPipeline()(logits, batch)
        assert tokens[:3].tolist() == logits[:3].argmax(1).tolist()
        top3 = logits[3:].topk(3, dim=1).indices
        assert all(int(t) in top3[i].tolist() for i, t in enumerate(tokens[3:]))


def test_sample_shortcut_with_a_generator_is_reproducible() -> None:
    logits = torch.randn(1000)
    draws = [int(sample(logits, top_k=0, generator=torch.Generator().manual_seed(3))) for _ in range(3)]
    assert len(set(draws)) == 1
    assert sample(torch.randn(4, 1000), temperature=0.7).shape == (4,)


def _request(prompt: str, **params) -> GenerateRequest:
    return GenerateRequest(prompt=prompt, max_tokens=24, ignore_eos=True, **params)


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(engine: InferenceEngine) -> None:
    prompt = "Write a sentence about the ocean:"
    first = engine.submit(_request(prompt, temperature=1.0, seed=1234)).wait(60)
    second = engine.submit(_request(prompt, temperature=1.0, seed=1234)).wait(60)
    assert first.token_ids == second.token_ids
    crowd = [engine.submit(_request(f"Noise prompt {i}:", temperature=1.0)) for i in range(4)]
    batched = engine.submit(_request(prompt, temperature=1.0, seed=1234))
    for result in crowd:
        result.wait(60)
    assert batched.wait(60).token_ids == first.token_ids
    others = {tuple(engine.submit(_request(prompt, temperature=1.0, seed=s)).wait(60).token_ids) for s in (1, 2, 3)}
    assert others != {tuple(first.token_ids)}


def test_top_k_one_equals_greedy(engine: InferenceEngine) -> None:
    prompt = "The three primary colours are"
    greedy = engine.submit(_request(prompt, temperature=0)).wait(60)
    top1 = engine.submit(_request(prompt, temperature=1.3, top_k=1)).wait(60)
    assert top1.token_ids == greedy.token_ids


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 2.0)])
def test_bad_sampling_values_name_their_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        GenerateRequest(prompt="x", **{field: value})


def test_logit_bias_allowed_and_banned_tokens_apply_to_greedy_rows_too() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0]] * 4)
    params = [
        SamplingParams(temperature=0, logit_bias={2: 10.0}),
        SamplingParams(temperature=0, logit_bias={0: -100.0}),
        SamplingParams(temperature=0, allowed_token_ids=[3, 1]),
        SamplingParams(temperature=0),
    ]
    banned = [frozenset(), frozenset(), frozenset(), frozenset({0, 1})]
    batch = SamplingBatch.build(params, logits.device, banned=banned)
    assert SamplingPipeline()(logits, batch).tolist() == [2, 1, 1, 2]
    sampled = SamplingBatch.build([SamplingParams(temperature=1.0, allowed_token_ids=[3])] * 8, logits.device)
    assert SamplingPipeline()(torch.randn(8, 4), sampled).tolist() == [3] * 8
