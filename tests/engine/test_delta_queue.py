"""DeltaQueue, the host's queue of one request's deltas: what a reader that fell behind gets, the end, and a
reader that leaves (no model: deltas are put by a thread as the engine process's reader puts them)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from serve_app.engine.delta_queue import DeltaQueue
from serve_app.wire.outputs import StreamDelta, Usage


def _delta(text: str, token: int, finish: str | None = None, usage: Usage | None = None) -> StreamDelta:
    return StreamDelta(text, (token,), finish, usage=usage)  # type: ignore[arg-type]


def test_a_reader_behind_gets_what_piled_up_as_one_delta_then_the_end() -> None:
    stream = DeltaQueue(abort=lambda task_id: None)
    stream.put(_delta("a", 1, usage=Usage(3, 1, 0)))
    stream.put(_delta("b", 2))

    async def read() -> list[StreamDelta]:
        taken = [await anext(stream)]
        threading.Thread(target=stream.put, args=(_delta("c", 3, "stop", Usage(3, 3, 0)),)).start()
        taken += [delta async for delta in stream]
        return taken

    first, last = asyncio.run(read())
    assert (first.text, first.token_ids, first.usage) == ("ab", (1, 2), Usage(3, 1, 0))
    assert (last.text, last.finish_reason, last.usage) == ("c", "stop", Usage(3, 3, 0))


def test_closing_it_unfinished_aborts_the_request_once_and_a_finished_one_not_at_all() -> None:
    aborted: list[int] = []
    unfinished, finished = DeltaQueue(aborted.append), DeltaQueue(aborted.append)
    unfinished.task_id, finished.task_id = 7, 8
    finished.put(_delta("x", 1, "length"))

    async def close() -> None:
        await unfinished.aclose()
        await finished.aclose()
        with pytest.raises(StopAsyncIteration):
            await anext(unfinished)

    asyncio.run(close())
    assert aborted == [7]


def test_a_reader_cancelled_while_waiting_leaves_nothing_for_the_putter_to_wake() -> None:
    stream = DeltaQueue(abort=lambda task_id: None)

    async def wait_then_give_up() -> None:
        reading = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.01)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading

    asyncio.run(wait_then_give_up())  # its loop is closed now
    stream.put(_delta("late", 1, "stop"))  # must not reach for the closed loop
    assert stream.wait(1).text == "late"
