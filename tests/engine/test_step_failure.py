"""A step that raises for one request (a fault injected into the forward) fails that request only."""

from __future__ import annotations

import logging

import pytest

from serve_app import GenerateRequest, InferenceEngine
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
        bad, *results = engine.loop.call(lambda: [engine.submit(r) for r in [poisoned, *requests]])
        bad.wait(60)
        for result in results:
            result.wait(120)
    assert "running its 4 requests one by one" in caplog.text
    assert bad.wait(60).finish_reason == "error" and "injected tensor error" in (bad.error or "")
    assert [r.wait(120).token_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)
    # And the engine keeps serving.
    assert engine.submit(GenerateRequest(prompt=good[1], max_tokens=4, temperature=0)).wait(60).finish_reason
