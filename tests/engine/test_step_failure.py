"""A step that raises for one request (a fault injected into the forward) fails that request only."""

from __future__ import annotations

import logging

import pytest

from serve_app import GenerateRequest, InferenceEngine
from serve_app.engine.emitting import SAMPLING_FAILED
from serve_app.engine.loop import STEP_FAILED
from tests.prompts import oracle_prompts
from tests.references import ReferenceModel

POISON = 48_999  # a token id that breaks any forward it is part of


def test_the_failing_request_ends_with_an_error_and_the_others_stay_exact(
    engine: InferenceEngine, reference: ReferenceModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    good = oracle_prompts(engine.tokenizer)[:3]
    expected = [reference.greedy(ids, 16) for ids in good]
    assert all(POISON not in ids for ids in good + expected)
    forward = engine.runner.forward

    def failing_forward(batch, view):
        if POISON in batch.token_ids:
            raise RuntimeError("injected tensor error")
        return forward(batch, view)

    monkeypatch.setattr(engine.runner, "forward", failing_forward)
    requests = [GenerateRequest(prompt=ids, max_tokens=16, temperature=0, ignore_eos=True) for ids in good]
    poisoned = GenerateRequest(prompt=good[0][:6] + [POISON], max_tokens=16, temperature=0, ignore_eos=True)
    with caplog.at_level(logging.ERROR, logger="serve_app.engine.loop"):
        # Submitted between two steps, so that all four are admitted into the same batch.
        streams = engine.loop.call(lambda: [engine.submit(r) for r in [poisoned, *requests]])
        bad, *results = [stream.wait(120) for stream in streams]
    assert "running its 4 requests one by one" in caplog.text
    assert bad.finish_reason == "error" and bad.error == STEP_FAILED
    assert "injected tensor error" in caplog.text  # the log says what failed; the client is not told
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)
    # And the engine keeps serving.
    assert engine.submit(GenerateRequest(prompt=good[1], max_tokens=4, temperature=0)).wait(60).finish_reason


def test_a_request_whose_sampling_fails_fails_alone_without_running_the_batch_again(
    engine: InferenceEngine, reference: ReferenceModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    good = oracle_prompts(engine.tokenizer)[:3]
    expected = [reference.greedy(ids, 8) for ids in good]
    sampler = engine.loop.step.emitter.sampler
    sample = type(sampler).__call__
    forwards = []
    forward = engine.runner.forward

    def counting_forward(batch, view):
        forwards.append(len(batch.token_ids))
        return forward(batch, view)

    def failing_sample(self, logits, batch, drafts=None):
        if any(p.seed == 666 for p in batch.params):
            raise RuntimeError("injected sampling error")
        return sample(self, logits, batch, drafts)

    monkeypatch.setattr(engine.runner, "forward", counting_forward)
    monkeypatch.setattr(type(sampler), "__call__", failing_sample)
    requests = [GenerateRequest(prompt=ids, max_tokens=8, temperature=0, ignore_eos=True) for ids in good]
    poisoned = GenerateRequest(prompt=good[0], max_tokens=8, temperature=0.7, seed=666, ignore_eos=True)
    with caplog.at_level(logging.WARNING):
        streams = engine.loop.call(lambda: [engine.submit(r) for r in [poisoned, *requests]])
        bad, *results = [stream.wait(120) for stream in streams]
        assert [r.token_ids for r in results] == expected
    assert bad.finish_reason == "error" and bad.error == SAMPLING_FAILED
    assert "injected sampling error" in caplog.text
    assert "sampling each alone" in caplog.text and "one by one" not in caplog.text
    # Every forward ran once: the prefill of all four, then seven decodes of the three left.
    assert len(forwards) == 8, forwards
