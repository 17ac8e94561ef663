"""DeltaQueue: one request's deltas on the engine process's host, from the reader thread to one consumer.

The host's reader thread puts each delta as the engine's round message brings it; the consumer takes
what has come (merged into one delta when it fell behind), with `async for` or, blocking, `wait`.
It is the only object between the engine process's message and the consumer: no result is rebuilt.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from serve_app.wire.outputs import StreamDelta, merge_deltas


class DeltaQueue:
    """A request's deltas, put by one thread and taken by one consumer. Closing it unfinished aborts the request."""

    def __init__(self, abort: Callable[[int], None]) -> None:
        self.task_id: int | None = None  # set once the engine has accepted the request
        self.call_id: int | None = None  # the host's submit call that asked for it
        self._abort = abort
        self._lock = threading.Condition()
        self._pending: list[StreamDelta] = []
        self._wake: Callable[[], None] | None = None  # the async consumer's wake-up, while it waits
        self._put_last = False  # the delta with a finish reason has been put
        self._took_last = False  # ... and taken

    def put(self, delta: StreamDelta) -> None:
        """From the reader thread: one delta of the request, in order."""
        with self._lock:
            self._pending.append(delta)
            self._put_last = delta.finish_reason is not None
            self._lock.notify_all()
            wake, self._wake = self._wake, None
        if wake is not None:
            try:
                wake()
            except RuntimeError:  # the consumer's event loop has closed: nobody is reading any more
                pass

    def __aiter__(self) -> DeltaQueue:
        return self

    async def __anext__(self) -> StreamDelta:
        while True:
            with self._lock:
                delta = self._take()
                if delta is None:
                    if self._took_last:
                        raise StopAsyncIteration
                    loop = asyncio.get_running_loop()
                    arrived = loop.create_future()
                    self._wake = wake = lambda: loop.call_soon_threadsafe(_resolve, arrived)
            if delta is not None:
                return delta
            try:
                await arrived
            finally:  # cancelled while waiting: no wake-up for a reader that has gone
                with self._lock:
                    if self._wake is wake:
                        self._wake = None

    def wait(self, timeout: float | None = None) -> StreamDelta:
        """Block until the request has finished; the deltas not taken yet (all of them, if none was), as one."""
        with self._lock:
            if not self._lock.wait_for(lambda: self._put_last, timeout):
                raise TimeoutError(f"the request did not finish within {timeout} s")
            delta = self._take()
        if delta is None:
            raise RuntimeError("the request's deltas were all taken already")
        return delta

    async def aclose(self) -> None:
        """Stop reading: a request not finished yet is aborted in the engine."""
        with self._lock:
            unfinished = not self._put_last
            self._took_last = True
            self._wake = None
        if unfinished and self.task_id is not None:
            self._abort(self.task_id)

    def _take(self) -> StreamDelta | None:
        """What has come since the last take, as one delta (under the lock); None when nothing has."""
        if not self._pending:
            return None
        delta = merge_deltas(self._pending)
        self._pending = []
        self._took_last = delta.finish_reason is not None
        return delta


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
