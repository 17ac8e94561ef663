"""DeltaStream, one request's deltas from the thread that puts its core outputs to its consumer, made text by its
output processor: what a reader that fell behind gets, the end, a reader that leaves, a listener, the whole
outcome, and a stop string that ends the request before the core does (no model: outputs are put by a thread as
the scheduler or the engine process's reader puts them; the tokenizer is the default model's)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from serve_app.engine.delta_stream import DeltaStream
from serve_app.engine.output_processor import OutputProcessor
from serve_app.model.tokenizer import Tokenizer
from serve_app.wire.outputs import CoreOutput, StreamDelta, Usage
from serve_app.wire.requests import EncodedRequest, GenerateRequest

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def tokenizer(model_path: Path) -> Tokenizer:
    return Tokenizer(model_path)


@pytest.fixture(scope="module")
def words(tokenizer: Tokenizer) -> list[int]:
    """Token ids of whole words, each its own text."""
    return [tokenizer.encode(word)[-1] for word in (" red", " green", " blue", " grey")]


def _stream(tokenizer: Tokenizer, aborted: list[int] | None = None, listener=None, **fields) -> DeltaStream:
    request = EncodedRequest(GenerateRequest(prompt=PROMPT, **fields), PROMPT)
    abort = aborted.append if aborted is not None else (lambda task_id: None)
    return DeltaStream(OutputProcessor(tokenizer, request), abort, listener)


def _output(token: int, finish: str | None = None, usage: Usage | None = None) -> CoreOutput:
    return CoreOutput((token,), ("answer",), finish, usage=usage)  # type: ignore[arg-type]


def test_a_reader_behind_gets_what_piled_up_as_one_delta_then_the_end(tokenizer: Tokenizer, words: list[int]) -> None:
    stream = _stream(tokenizer)
    stream.put(_output(words[0], usage=Usage(3, 1, 0)))
    stream.put(_output(words[1]))

    async def read() -> list[StreamDelta]:
        taken = [await anext(stream)]
        threading.Thread(target=stream.put, args=(_output(words[2], "stop", Usage(3, 3, 0)),)).start()
        taken += [delta async for delta in stream]
        return taken

    first, last = asyncio.run(read())
    assert (first.text, first.token_ids, first.usage) == (" red green", tuple(words[:2]), Usage(3, 1, 0))
    assert (last.text, last.finish_reason, last.usage) == (" blue", "stop", Usage(3, 3, 0))


def test_closing_it_unfinished_aborts_the_request_once_and_a_finished_one_not_at_all(
    tokenizer: Tokenizer, words: list[int]
) -> None:
    aborted: list[int] = []
    unfinished, finished = _stream(tokenizer, aborted), _stream(tokenizer, aborted)
    unfinished.accepted(7)
    finished.accepted(8)
    finished.put(_output(words[0], "length", Usage(3, 1, 0)))

    async def close() -> None:
        await unfinished.aclose()
        await finished.aclose()
        with pytest.raises(StopAsyncIteration):
            await anext(unfinished)

    asyncio.run(close())
    assert aborted == [7]


def test_a_reader_cancelled_while_waiting_leaves_nothing_for_the_putter_to_wake(
    tokenizer: Tokenizer, words: list[int]
) -> None:
    stream = _stream(tokenizer)

    async def wait_then_give_up() -> None:
        reading = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.01)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading

    asyncio.run(wait_then_give_up())  # its loop is closed now
    stream.put(_output(words[3], "stop", Usage(3, 1, 0)))  # must not reach for the closed loop
    assert stream.wait(1).text == " grey"


def test_a_listener_sees_every_delta_and_a_blocking_reader_that_leaves_early_aborts(
    tokenizer: Tokenizer, words: list[int]
) -> None:
    aborted: list[int] = []
    heard: list[StreamDelta] = []
    stream = _stream(tokenizer, aborted, heard.append)
    stream.accepted(3)
    threading.Thread(target=lambda: [stream.put(_output(token)) for token in words[:3]]).start()
    for delta in stream:
        assert delta.text.startswith(" red")
        break
    assert aborted == [3]
    deadline = time.monotonic() + 5
    while len(heard) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "".join(d.text for d in heard) == " red green blue"


def test_waiting_gives_the_whole_outcome(tokenizer: Tokenizer, words: list[int]) -> None:
    stream = _stream(tokenizer)
    stream.put(_output(words[0], usage=Usage(3, 1, 4)))
    threading.Thread(target=stream.put, args=(_output(words[1], "length", Usage(3, 2, 4)),)).start()
    whole = stream.wait(5)
    assert (whole.text, whole.token_ids, whole.finish_reason, whole.cached_tokens) == (" red green", words[:2], "length", 4)


def test_a_stop_string_ends_the_request_aborts_it_in_the_core_and_drops_what_follows(
    tokenizer: Tokenizer, words: list[int]
) -> None:
    aborted: list[int] = []
    early = _stream(tokenizer, aborted, stop=["een"])
    early.put(_output(words[0], usage=Usage(3, 1, 0)))
    # One step's proposals accepted together: the stop string ends the request inside them.
    early.put(CoreOutput((words[1], words[2]), ("answer", "answer")))
    assert aborted == []  # not accepted yet: it is aborted once the engine says which task it is
    early.accepted(5)
    assert aborted == [5]
    early.put(_output(words[3], "cancelled", Usage(3, 4, 0)))  # what the core sent before the abort reached it
    whole = early.wait(1)
    assert (whole.text, whole.finish_reason, whole.stop_string) == (" red gr", "stop", "een")
    assert whole.token_ids == words[:2] and whole.usage.completion_tokens == 2

    held = _stream(tokenizer, aborted, stop=["een"], min_tokens=3)  # no stop string ends it under min_tokens
    held.accepted(6)
    for token in words[:3]:
        held.put(_output(token))
    held.put(_output(words[3], "length", Usage(3, 4, 0)))
    assert held.wait(1).text == " red green blue grey" and aborted == [5]


def test_text_that_cannot_be_made_fails_its_request_alone_and_aborts_it(
    tokenizer: Tokenizer, words: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    aborted: list[int] = []
    broken, fine = _stream(tokenizer, aborted), _stream(tokenizer, aborted)
    broken.accepted(1)
    fine.accepted(2)
    decode = tokenizer.decode

    def failing_decode(ids, skip_special_tokens=True):
        if words[1] in ids:
            raise RuntimeError("injected decode error")
        return decode(ids, skip_special_tokens)

    monkeypatch.setattr(tokenizer, "decode", failing_decode)
    broken.put(_output(words[0], usage=Usage(3, 1, 0)))
    broken.put(_output(words[1]))  # raises inside: the putting thread goes on
    broken.put(_output(words[2], "length", Usage(3, 3, 0)))  # dropped: the request has ended
    fine.put(_output(words[2], "length", Usage(3, 1, 0)))
    failed = broken.wait(1)
    assert (failed.finish_reason, failed.text, failed.token_ids) == ("error", " red", [words[0]])
    assert failed.error is not None and "text failed" in failed.error and aborted == [1]
    assert fine.wait(1).text == " blue"
