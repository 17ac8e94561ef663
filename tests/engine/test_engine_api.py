"""The in-process Engine API: return shapes, chat prompts, async, cancellation, bad input, stats."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from serve_app import EngineConfig, GenerateRequest, InferenceEngine, StreamDelta
from serve_app.bench.idle import wait_idle
from serve_app.model.loader import ModelNotFoundError

GREEDY = dict(max_tokens=12, temperature=0)


def test_generate_returns_text_for_a_prompt_and_a_list_for_a_batch(engine: InferenceEngine) -> None:
    one = engine.generate("The sun rises in the", **GREEDY)
    assert isinstance(one, str) and one
    both = engine.generate(["The sun rises in the", "Water boils at"], **GREEDY)
    assert isinstance(both, list) and both[0] == one and len(both) == 2
    by_ids = engine.generate(engine.tokenizer.encode("The sun rises in the"), **GREEDY)
    assert by_ids == one


def test_streams_join_to_the_whole_text(engine: InferenceEngine) -> None:
    prompts = ["The sun rises in the", "Water boils at"]
    whole = engine.generate(prompts, **GREEDY)
    deltas = list(engine.generate(prompts[0], stream=True, **GREEDY))
    assert all(isinstance(d, str) for d in deltas) and "".join(deltas) == whole[0]
    tagged = list(engine.generate(prompts, stream=True, **GREEDY))
    assert {i for i, _ in tagged} == {0, 1}
    for index in (0, 1):
        assert "".join(text for i, text in tagged if i == index) == whole[index]


def test_generate_async_yields_the_same_deltas(engine: InferenceEngine) -> None:
    expected = engine.generate("Three facts about cats:", **GREEDY)

    async def collect() -> list[str]:
        return [d async for d in engine.generate_async("Three facts about cats:", **GREEDY)]

    assert "".join(asyncio.run(collect())) == expected


def test_chat_request_uses_the_template_with_system_and_turns(engine: InferenceEngine) -> None:
    messages = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Colour of the sky?"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Colour of grass?"},
    ]
    ids = engine.tokenizer.encode_chat(messages)
    rendered = engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert rendered.startswith("<|im_start|>system\nYou answer in one word.<|im_end|>")
    assert "You are a helpful AI assistant" not in rendered
    assert rendered.endswith("<|im_start|>user\nColour of grass?<|im_end|>\n<|im_start|>assistant\n")
    from_chat = engine.generate_with_request(GenerateRequest(messages=messages, **GREEDY))
    assert from_chat == engine.generate(ids, **GREEDY)
    result = engine.submit(GenerateRequest(messages=messages, **GREEDY)).wait(60)
    assert result.usage.prompt_tokens == len(ids)
    assert result.usage.completion_tokens == len(result.token_ids) <= 12


def test_closing_a_stream_cancels_the_task(engine: InferenceEngine) -> None:
    before = engine.get_stats()
    stream = engine.generate("Tell me a very long story:", stream=True, max_tokens=500, ignore_eos=True)
    next(stream)
    next(stream)
    stream.close()
    after = wait_idle(engine.get_stats, timeout=10)
    assert after["total_tasks"] == before["total_tasks"] + 1
    assert after["total_tokens"] - before["total_tokens"] < 500  # cut short, not run to max_tokens


def test_abort_by_task_id(engine: InferenceEngine) -> None:
    seen: list[StreamDelta] = []
    stream = engine.submit(GenerateRequest(prompt="Once upon a time", max_tokens=500, ignore_eos=True), seen.append)
    while not seen:
        time.sleep(0.005)
    assert stream.task_id is not None
    engine.abort(stream.task_id)
    result = stream.wait(10)
    assert result.finish_reason == "cancelled" and len(result.token_ids) < 500


def test_async_consumer_that_stops_early_cancels(engine: InferenceEngine) -> None:
    before = engine.get_stats()

    async def take_two() -> None:
        agen = engine.generate_async("A list of numbers:", max_tokens=400, ignore_eos=True)
        count = 0
        async for _ in agen:
            count += 1
            if count == 2:
                break
        await agen.aclose()

    asyncio.run(take_two())
    after = wait_idle(engine.get_stats, timeout=10)
    assert after["total_tasks"] == before["total_tasks"] + 1
    assert after["total_tokens"] - before["total_tokens"] < 400  # cut short, not run to max_tokens


def test_an_async_add_whose_caller_leaves_leaves_nothing_running(
    engine: InferenceEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = engine.get_stats()
    checking, release = threading.Event(), threading.Event()
    make_task = engine.intake.task

    def slow_task(*args, **kwargs):  # as a grammar's compile would be
        checking.set()
        assert release.wait(30)
        return make_task(*args, **kwargs)

    monkeypatch.setattr(engine.intake, "task", slow_task)

    async def leave_while_checking() -> None:
        request = engine.encode(GenerateRequest(prompt="Go on and on:", max_tokens=400, ignore_eos=True))
        adding = asyncio.create_task(engine.add_request_async(request))
        while not checking.is_set():
            await asyncio.sleep(0.005)
        adding.cancel()
        with pytest.raises(asyncio.CancelledError):
            await adding
        release.set()  # the add now queues the request, which must be aborted

    asyncio.run(leave_while_checking())
    after = wait_idle(engine.get_stats, timeout=10)
    assert after["total_tasks"] - before["total_tasks"] == 1
    assert after["total_tokens"] - before["total_tokens"] < 400  # aborted, not run to max_tokens


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(prompt=""), "prompt"),
        (dict(prompt=[]), "prompt"),
        (dict(prompt="x", max_tokens=0), "max_tokens"),
        (dict(prompt="x", temperature=-1), "temperature"),
        (dict(prompt="x", top_p=0), "top_p"),
        (dict(prompt="x", top_p=1.01), "top_p"),
        (dict(prompt=[10**9]), "prompt"),
        (dict(prompt="x", stop_token_ids=[-5]), "stop_token_ids"),
        (dict(prompt="x", unknown_field=1), "unknown_field"),
        (dict(), "prompt or messages"),
        (dict(prompt="x", messages=[{"role": "user", "content": "y"}]), "prompt or messages"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_field_and_the_engine_keeps_serving(
    engine: InferenceEngine, kwargs: dict, field: str
) -> None:
    before = engine.get_stats()["total_tasks"]
    with pytest.raises(ValueError, match=field):
        engine.submit(GenerateRequest(**kwargs))
    assert engine.get_stats()["total_tasks"] == before
    assert engine.generate("Still here:", **GREEDY)


def test_too_long_prompt_names_the_prompt(engine: InferenceEngine) -> None:
    with pytest.raises(ValueError, match="prompt: 2048 tokens"):
        engine.generate([5] * 2048, max_tokens=1)


def test_stats_count_what_the_engine_did(engine: InferenceEngine) -> None:
    before = engine.get_stats()
    assert before["kv_pages_total"] == 8192 // 16 and before["kv_pages_free"] == before["kv_pages_total"]
    assert before["active_tasks"] == 0 and before["waiting_queue"] == 0
    prompt = engine.tokenizer.encode("Stats are counted here. " * 6)  # more than two full pages
    first = engine.submit(GenerateRequest(prompt=prompt, max_tokens=5, ignore_eos=True, temperature=0)).wait(60)
    running = engine.get_stats()
    second = engine.submit(GenerateRequest(prompt=prompt, max_tokens=3, ignore_eos=True, temperature=0)).wait(60)
    after = wait_idle(engine.get_stats)
    assert after["total_tasks"] - before["total_tasks"] == 2
    assert after["total_tokens"] - before["total_tokens"] == 5 + 3
    assert after["prompt_tokens"] - before["prompt_tokens"] == 2 * len(prompt)
    hits = (len(prompt) - 1) // 16 * 16  # the second finds the first's full pages, minus its last token's
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == hits == second.cached_tokens
    assert after["prefill_tokens"] - before["prefill_tokens"] == 2 * len(prompt) - hits
    assert after["steps"] > running["steps"] > before["steps"] and after["preemptions"] == before["preemptions"]
    assert first.usage.prompt_tokens == len(prompt)


def test_unknown_model_and_unknown_option_are_value_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="model"):
        InferenceEngine(model=str(tmp_path / "nothing-here"))
    with pytest.raises(ValueError, match="unknown engine option"):
        EngineConfig.from_options(kv_pages=3)
    with pytest.raises(ValueError, match="kind"):
        EngineConfig.from_options(kv_cache="ring")


def test_shutdown_cancels_unfinished_requests(tiny_llama_path: Path) -> None:
    eng = InferenceEngine(compile=False, model=str(tiny_llama_path), cache_tokens=2048)
    seen: list[StreamDelta] = []
    stream = eng.submit(GenerateRequest(prompt="Go on forever", max_tokens=900, ignore_eos=True), seen.append)
    while not seen:
        time.sleep(0.005)
    eng.shutdown()
    result = stream.wait(10)
    assert result.finish_reason == "cancelled" and len(result.token_ids) < 900
    with pytest.raises(RuntimeError, match="shut down"):
        eng.submit(GenerateRequest(prompt="late", max_tokens=1))
