"""DeltaStream: one request's deltas, from the thread that puts its core outputs to the one consumer that takes them.

The one stream type of the engine's clients: in process the scheduler thread puts each output as a step
publishes it; across a process the host's reader thread puts each output as the round message brings it. Its
`OutputProcessor` makes each a delta as it is put (text, reasoning, stop strings); where a stop string ends the
request first, the stream aborts it in the core. The consumer takes what has come (merged into one delta when it
fell behind) with `async for`, `for`, or, blocking until the end, `wait` (a `RequestOutput`). A listener (given
when the stream is made, so it misses nothing) sees each delta on the putting thread. Closing the stream before
its last delta aborts the request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator

from serve_app.engine.output_processor import OutputProcessor
from serve_app.wire.outputs import CoreOutput, RequestOutput, StreamDelta, merge_deltas

logger = logging.getLogger(__name__)

# What a client is told when its tokens' text could not be made (the exception is in the log).
TEXT_FAILED = "making this request's text failed (the server's log says why)"

# Sees each delta as it is put, on the putting thread (a scheduler's or a reader's): keep it tiny.
DeltaListener = Callable[[StreamDelta], None]


class DeltaStream:
    """A request's deltas, put by one thread and taken by one consumer. Closing it unfinished aborts the request."""

    def __init__(
        self, processor: OutputProcessor, abort: Callable[[int], None], listener: DeltaListener | None = None
    ) -> None:
        self.task_id: int | None = None  # set once the engine has accepted the request (`accepted`)
        self.call_id: int | None = None  # across a process: the host's submit call that asked for it
        self._processor = processor
        self._abort = abort
        self._abort_on_acceptance = False  # it ended here before the engine said which task it is
        self._listener = listener
        self._lock = threading.Condition()
        self._pending: list[StreamDelta] = []
        self._wake: Callable[[], None] | None = None  # the async consumer's wake-up, while it waits
        self._put_last = False  # the delta with a finish reason has been put
        self._took_last = False  # ... and taken

    @property
    def finished(self) -> bool:
        """The last delta has been put (it may not have been taken yet)."""
        return self._put_last

    def accepted(self, task_id: int) -> None:
        """The engine queued the request as task `task_id` (its outputs may have come first)."""
        with self._lock:
            self.task_id = task_id
            abort, self._abort_on_acceptance = self._abort_on_acceptance, False
        if abort:
            self._abort(task_id)

    def put(self, output: CoreOutput) -> None:
        """From the putting thread: one core output of the request, in order, made a delta (none after its end)."""
        try:
            delta = self._processor.process(output)
        except Exception:  # this request's text only: it fails alone, and no thread that puts it dies
            logger.exception("making the text of task %s failed", self.task_id)
            delta = self._processor.failed(output, TEXT_FAILED)
        if delta is None:
            return
        if self._processor.ended_here:  # a stop string or a failure here: the core has not ended it
            with self._lock:
                task_id = self.task_id
                self._abort_on_acceptance = task_id is None
            if task_id is not None:
                self._abort(task_id)
        with self._lock:
            self._pending.append(delta)
            self._put_last = delta.finish_reason is not None
            self._lock.notify_all()
            wake, self._wake = self._wake, None
        if self._listener is not None:
            self._listener(delta)
        if wake is not None:
            try:
                wake()
            except RuntimeError:  # the consumer's event loop has closed: nobody is reading any more
                pass

    def __aiter__(self) -> DeltaStream:
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

    def __iter__(self) -> Iterator[StreamDelta]:
        """Deltas as they come, blocking between them; leaving the loop early aborts the request."""
        try:
            while True:
                with self._lock:
                    self._lock.wait_for(lambda: self._pending or self._took_last)
                    delta = self._take()
                if delta is None:
                    return
                yield delta
                if self._took_last:
                    return
        finally:
            self.close()

    def wait(self, timeout: float | None = None) -> RequestOutput:
        """Block until the request has finished; what the deltas not taken yet (all of them, if none was) amount to."""
        with self._lock:
            if not self._lock.wait_for(lambda: self._put_last, timeout):
                raise TimeoutError(f"the request did not finish within {timeout} s")
            delta = self._take()
        if delta is None:
            raise RuntimeError("the request's deltas were all taken already")
        return RequestOutput.of(delta)

    def close(self) -> None:
        """Stop reading: a request not finished yet is aborted in the engine."""
        with self._lock:
            unfinished = not self._put_last
            self._took_last = True
            self._wake = None
            self._lock.notify_all()
        if unfinished and self.task_id is not None:
            self._abort(self.task_id)

    async def aclose(self) -> None:
        self.close()

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
