"""EngineProcess: the engine in a child process answers as the in-process engine does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from serve_app.bench.idle import wait_idle
from serve_app.config import EngineConfig
from serve_app.engine.engine import InferenceEngine
from serve_app.engine.process import EngineProcess, EngineProcessError
from serve_app.wire.calls import GetKVConfig, GetStats, LookupKV, RetrieveKV, StoreKV
from serve_app.wire.refusals import InvalidRequestError
from serve_app.wire.requests import EncodedRequest, GenerateRequest

OPTIONS = dict(kv_cache="paged", page_size=16, cache_tokens=4096, max_model_len=512)
PROMPTS = ([5, 17, 300, 41], list(range(100, 140)), [7] * 19)


@pytest.fixture(scope="module")
def config(tiny_llama_path: Path) -> EngineConfig:
    return EngineConfig.from_options(model=str(tiny_llama_path), compile=False, **OPTIONS)


@pytest.fixture(scope="module")
def process(config: EngineConfig) -> Iterator[EngineProcess]:
    engine = EngineProcess(config)
    yield engine
    engine.shutdown()


def _greedy(prompt: list[int], max_tokens: int = 12, **extra) -> EncodedRequest:
    return _ids(GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, **extra))


def _ids(request: GenerateRequest) -> EncodedRequest:
    """A request whose prompt is token ids, as the engine runs it (nothing to tokenize)."""
    assert isinstance(request.prompt, list)
    return EncodedRequest(request, list(request.prompt))


def _stats(engine: EngineProcess) -> dict[str, int]:
    return engine.answer(GetStats())


def test_tokens_and_usage_equal_the_in_process_engine(process: EngineProcess, config: EngineConfig) -> None:
    local = InferenceEngine(config=config)
    try:
        expected = [local.add_request(_greedy(p)).wait(60) for p in PROMPTS]
    finally:
        local.shutdown()
    streams = [process.add_request(_greedy(p)) for p in PROMPTS]  # all in flight together
    for stream, reference in zip(streams, expected):
        whole = stream.wait(60)
        assert whole.token_ids == reference.token_ids and whole.text == reference.text
        assert whole.finish_reason == "length" and whole.usage == reference.usage
    assert process.max_model_len == 512


def test_a_stream_is_the_whole_result_in_order(process: EngineProcess) -> None:
    whole = process.add_request(_greedy(PROMPTS[1], 20)).wait(60)

    async def streamed() -> list:
        stream = await process.add_request_async(_greedy(PROMPTS[1], 20))
        return [delta async for delta in stream]

    deltas = asyncio.run(streamed())
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert deltas[0].usage is not None and deltas[-1].finish_reason == "length"
    # The second run found the first one's prompt in the prefix cache, and says so.
    assert deltas[-1].usage.cached_tokens == 32


def test_refusals_arrive_as_the_engine_raised_them(process: EngineProcess) -> None:
    queued = process.answer(GetStats())["total_tasks"]
    with pytest.raises(InvalidRequestError) as vocab:
        process.add_request(_ids(GenerateRequest(prompt=[10**7], max_tokens=2)))
    assert vocab.value.param == "prompt" and "outside the vocabulary" in vocab.value.message
    with pytest.raises(InvalidRequestError) as room:
        process.add_request(_ids(GenerateRequest(prompt=[5, 6], max_tokens=5000)))
    assert room.value.param == "max_tokens"
    assert process.answer(GetStats())["total_tasks"] == queued  # a refused request is never queued


def test_abandoning_a_stream_cancels_it_and_frees_its_pages(process: EngineProcess) -> None:
    before = wait_idle(lambda: _stats(process))

    async def read_two() -> int:
        stream = await process.add_request_async(_greedy(PROMPTS[2], 400))
        taken = [await anext(stream), await anext(stream)]
        await stream.aclose()
        return len(taken)

    assert asyncio.run(read_two()) == 2
    stats = wait_idle(lambda: _stats(process))
    assert stats["total_tasks"] - before["total_tasks"] == 1
    assert stats["total_tokens"] - before["total_tokens"] < 400  # cut short, not run to max_tokens


def test_the_engine_process_pushes_its_stats(process: EngineProcess) -> None:
    """`latest_stats` follows the engine without a round trip: a finished request shows up in it."""
    before = wait_idle(lambda: _stats(process))
    process.add_request(_greedy(PROMPTS[0], 5)).wait(60)
    expected = {"total_tasks": before["total_tasks"] + 1, "total_tokens": before["total_tokens"] + 5, "active_tasks": 0}

    def shown(stats: dict[str, int]) -> dict[str, int]:
        return {key: stats[key] for key in expected}

    deadline = time.monotonic() + 5
    while shown(process.latest_stats) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    assert shown(process.latest_stats) == expected
    assert process.latest_stats == _stats(process)


def test_cached_kv_crosses_the_process(process: EngineProcess, config: EngineConfig) -> None:
    prompt = list(range(200, 248))
    process.add_request(_greedy(prompt, 1)).wait(60)
    assert process.answer(GetKVConfig()).page_size == 16
    assert process.answer(LookupKV(prompt)).cached_tokens == 48
    kv = process.answer(RetrieveKV(prompt))
    assert isinstance(kv, torch.Tensor) and kv.shape[2] == 48
    other = process.answer(StoreKV(kv, prompt, tenant_salt="elsewhere"))
    assert (other.stored_pages, other.deduplicated_pages) == (3, 0)
    assert torch.equal(process.answer(RetrieveKV(prompt, tenant_salt="elsewhere")), kv)
    with pytest.raises(InvalidRequestError) as bad:
        process.answer(StoreKV(kv[:, :, :20], prompt))
    assert bad.value.param == "tokens" and "48 tokens for KV of 20 positions" in bad.value.message


def test_a_killed_engine_process_fails_its_requests(config: EngineConfig) -> None:
    engine = EngineProcess(config)
    try:
        stream = engine.add_request(_greedy(PROMPTS[0], 400))
        engine._process.kill()
        whole = stream.wait(30)
        assert whole.finish_reason == "error" and "exited" in (whole.error or "")
        deadline = time.monotonic() + 10
        while engine.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.alive
        with pytest.raises(EngineProcessError):
            engine.add_request(_greedy(PROMPTS[0]))
        with pytest.raises(EngineProcessError):
            _ = engine.latest_stats
    finally:
        engine.shutdown()


def test_shutdown_cancels_unfinished_requests(config: EngineConfig) -> None:
    engine = EngineProcess(config)
    stream = engine.add_request(_greedy(PROMPTS[1], 400))
    engine.shutdown()
    whole = stream.wait(10)
    assert whole.finish_reason == "cancelled" and len(whole.token_ids) < 400
    assert not engine.alive


def test_a_submit_cancelled_before_the_engine_accepts_it_cancels_that_request_only(process: EngineProcess) -> None:
    before = wait_idle(lambda: _stats(process))

    async def scenario() -> list:
        kept = await process.add_request_async(_greedy(PROMPTS[1], 60))
        for _ in range(5):
            waiting = asyncio.create_task(process.add_request_async(_greedy(PROMPTS[2], 400)))
            await asyncio.sleep(0)  # the submit is on its way to the engine, not yet accepted
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
        return [delta async for delta in kept]

    deltas = asyncio.run(scenario())
    assert deltas[-1].finish_reason == "length" and sum(len(d.token_ids) for d in deltas) == 60
    assert process.alive
    after = wait_idle(lambda: _stats(process))
    assert after["total_tasks"] - before["total_tasks"] == 6  # the engine took all six...
    assert after["total_tokens"] - before["total_tokens"] < 60 + 5 * 400  # ...and cut the five short
    assert process.add_request(_greedy(PROMPTS[0], 3)).wait(30).finish_reason == "length"
