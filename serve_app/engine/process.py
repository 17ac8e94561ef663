"""EngineProcess: an InferenceEngine in a child process, reached as a `CoreClient` from this one.

The scheduler thread then shares no interpreter lock with its host. In a Ray Serve replica that
host runs event loops, Ray's threads and a serializer for every streamed item; sharing one
interpreter with them, the engine's single-client steps were about a quarter slower (TPOT
through HTTP 0.093 s in the replica, 0.074 s in its own process).

Nothing here blocks a caller's event loop: messages go out through one writer thread per
channel (a caller only queues them), and two reader threads hand the child's messages on: each
output (token ids) into its request's `DeltaStream`, whose output processor makes its text here, out of
the engine's process (the stream is made when the request is sent, so its outputs may come before the
engine's `Accepted`), each answer to its caller's future. A caller that gives up at any
moment (a cancelled `add_request_async` or `answer_async`) costs only its own request: a request the
engine accepts for a caller that has gone is aborted there. The wire is `serve_app.engine.messages`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from serve_app.config import EngineConfig
from serve_app.engine.channel import ChannelWriter, EngineProcessError, settle, wait_ready
from serve_app.engine.delta_stream import DeltaListener, DeltaStream
from serve_app.engine.messages import (
    Abort,
    Accepted,
    Call,
    Health,
    Outputs,
    PagesChanged,
    Refused,
    Reply,
    ResendPages,
    Shutdown,
    Submit,
    ToEngine,
    Withdraw,
    receive,
)
from serve_app.engine.output_processor import OutputProcessor
from serve_app.model.tokenizer import Tokenizer
from serve_app.wire.calls import EngineCall
from serve_app.wire.outputs import CoreOutput
from serve_app.wire.page_events import PageEventBatch, PageEventBuffer
from serve_app.wire.requests import EncodedRequest

logger = logging.getLogger(__name__)

EXIT_WAIT_S = 30.0


class EngineProcess:
    """Starts `python -m CHILD` (`serve_app.engine.child`, or a module that runs its `main` with more, as
    `deployments.engine_child` does), waits until its engine is loaded, then serves through it."""

    def __init__(self, config: EngineConfig, start_timeout: float = 900.0, child: str = "serve_app.engine.child") -> None:
        stream_host, stream_child = socket.socketpair()
        call_host, call_child = socket.socketpair()
        with stream_child, call_child:
            fds = (stream_child.fileno(), call_child.fileno())
            self._process = subprocess.Popen(
                [sys.executable, "-m", child, *map(str, fds)], pass_fds=fds
            )
        self._streams = Connection(stream_host.detach())
        self._calls = Connection(call_host.detach())
        self._streams.send_bytes(config.model_dump_json().encode())
        try:
            ready = wait_ready(self._streams, self._process, start_timeout)
        except EngineProcessError:
            self._stop_process()
            raise
        # the text of the engine's token ids is made here, by the tokenizer the core exported (no torch here)
        self.tokenizer = Tokenizer(Path(ready.model_path), cache_dir=config.model.cache_dir)
        self.max_model_len = ready.max_model_len
        self.created = ready.created
        self.tool_format = ready.tool_format
        self.reasoning_parser = ready.reasoning_parser
        self.vocab_size = ready.vocab_size
        self.hidden_size = ready.hidden_size
        self._health = Health(ready.stats, True)
        self._page_events = PageEventBuffer()
        self._lock = threading.Lock()  # guards the tables below and `_exit_reason`
        self._ids = itertools.count(1)
        self._pending: dict[int, Future] = {}  # call id -> the answer to a submit or a call
        self._requests: dict[int, DeltaStream] = {}  # submit call id -> its request's stream, until the core's last output
        self._exit_reason: str | None = None
        self._stream_writer = ChannelWriter(self._streams, "engine-process-stream-writer", self._fail_everything)
        self._call_writer = ChannelWriter(self._calls, "engine-process-call-writer", self._fail_everything)
        self._readers = [
            threading.Thread(target=self._read, args=(self._streams, True), name="engine-process-stream-reader", daemon=True),
            threading.Thread(target=self._read, args=(self._calls, False), name="engine-process-call-reader", daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    # -- the serving API ----------------------------------------------------------------------
    def add_request(self, request: EncodedRequest, listener: DeltaListener | None = None) -> DeltaStream:
        """Queue one request; raise what the engine raised if it refused it."""
        accepted, stream = self._submit(request, listener)
        stream.accepted(accepted.result())
        return stream

    async def add_request_async(self, request: EncodedRequest) -> DeltaStream:
        """As `add_request`; a caller cancelled while it waits leaves nothing running in the engine."""
        accepted, stream = self._submit(request)
        try:
            stream.accepted(await asyncio.wrap_future(accepted))
        except asyncio.CancelledError:
            accepted.add_done_callback(self._abort_accepted)
            if stream.call_id is not None:
                with contextlib.suppress(EngineProcessError):  # nothing left to withdraw from
                    self._post(self._stream_writer, Withdraw(stream.call_id))
            raise
        return stream

    def _submit(self, request: EncodedRequest, listener: DeltaListener | None = None) -> tuple[Future, DeltaStream]:
        """The future of the task id the engine accepts the request as, and the request's stream (its deltas may
        come first, even all of them)."""
        stream = DeltaStream(OutputProcessor(self.tokenizer, request), self._abandon, listener)

        def message(call_id: int) -> Submit:
            self._requests[call_id] = stream  # under the lock, before the engine can send a delta
            stream.call_id = call_id
            return Submit(call_id, request)

        return self._request(message, self._stream_writer), stream

    def abort(self, task_id: int) -> None:
        self._post(self._stream_writer, Abort(task_id))

    def answer(self, call: EngineCall) -> Any:
        """What `call` asks of the engine (a round trip to its process); raises what the engine raised."""
        return self._request(lambda call_id: Call(call_id, call), self._call_writer).result()

    async def answer_async(self, call: EngineCall) -> Any:
        return await asyncio.wrap_future(self._request(lambda call_id: Call(call_id, call), self._call_writer))

    @property
    def latest_stats(self) -> dict[str, int]:
        """The stats the engine process last pushed: at most its HEALTH_EVERY_S old, no round trip."""
        with self._lock:
            if self._exit_reason is not None:
                raise EngineProcessError(self._exit_reason)
            return dict(self._health.stats)

    def get_stats(self) -> dict[str, int]:
        """`latest_stats`, as `InferenceEngine.get_stats` answers in process."""
        return self.latest_stats

    @property
    def alive(self) -> bool:
        return self._process.poll() is None and all(reader.is_alive() for reader in self._readers)

    @property
    def healthy(self) -> bool:
        """Alive, and the engine has not reported that its steps keep failing."""
        return self.alive and self._health.healthy

    def shutdown(self) -> None:
        """Stop the engine (unfinished requests end as cancelled) and wait for its process to exit."""
        try:
            self._post(self._stream_writer, Shutdown())
        except EngineProcessError:
            pass
        self._stream_writer.close(EXIT_WAIT_S)
        try:
            self._process.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            logger.warning("the engine process did not exit in %.0f s; killing it", EXIT_WAIT_S)
            self._process.kill()
            self._process.wait()
        self._call_writer.close(EXIT_WAIT_S)
        for reader in self._readers:  # they read the last deltas, then the end of each connection
            reader.join(EXIT_WAIT_S)
        self._streams.close()
        self._calls.close()

    # -- the wire ----------------------------------------------------------------------------
    def _request(self, message: Callable[[int], ToEngine], writer: ChannelWriter) -> Future:
        future: Future = Future()
        call_id = next(self._ids)
        with self._lock:
            if self._exit_reason is not None:
                raise EngineProcessError(self._exit_reason)
            self._pending[call_id] = future
            sent = message(call_id)
        writer.post(sent)
        return future

    def _post(self, writer: ChannelWriter, message: ToEngine) -> None:
        with self._lock:
            if self._exit_reason is not None:
                raise EngineProcessError(self._exit_reason)
        writer.post(message)

    def take_page_events(self) -> PageEventBatch:
        """The page hashes the engine's prefix cache published and dropped since the last call (the first
        call: a snapshot of what it holds)."""
        return self._page_events.take()

    def resend_pages(self) -> None:
        """Have the engine send a snapshot of its cached pages (a reader of the events has lost track)."""
        self._post(self._stream_writer, ResendPages())

    def _read(self, conn: Connection, is_stream: bool) -> None:
        try:
            while True:
                self._dispatch(receive(conn))
        except (EOFError, OSError):
            pass
        except Exception:
            logger.exception("the engine process sent a message that could not be read")
        if is_stream:
            self._process.poll()
            self._fail_everything(f"the engine process exited (exit code {self._process.returncode})")

    def _dispatch(self, message: Any) -> None:
        match message:
            case Outputs(items):
                for call_id, output in items:
                    self._publish(call_id, output)
            case Accepted(call_id, task_id):
                with self._lock:
                    future = self._pending.pop(call_id)
                if not settle(future, task_id):  # the caller gave up before the engine took it
                    self._abandon(task_id)
            case Refused(call_id, error):
                with self._lock:
                    future = self._pending.pop(call_id)
                    self._requests.pop(call_id, None)
                settle(future, error=error)
            case Reply(call_id, ok, value):
                with self._lock:
                    future = self._pending.pop(call_id)
                if ok:
                    settle(future, value)
                else:
                    settle(future, error=value)
            case Health():
                with self._lock:
                    self._health = message
            case PagesChanged(batch):
                self._page_events.add(batch)
            case _:
                logger.error("unknown message from the engine process: %r", message)

    def _publish(self, call_id: int, output: CoreOutput) -> None:
        with self._lock:
            stream = self._requests.get(call_id)
            if stream is not None and output.finish_reason is not None:
                del self._requests[call_id]
        if stream is not None:
            stream.put(output)

    def _abort_accepted(self, future: Future) -> None:
        """Done-callback of a submit whose caller was cancelled: abort the request if the engine took it."""
        if not future.cancelled() and future.exception() is None:
            self._abandon(future.result())

    def _abandon(self, task_id: int) -> None:
        try:
            self.abort(task_id)
        except EngineProcessError:
            pass  # nothing left to cancel

    def _fail_everything(self, reason: str) -> None:
        with self._lock:
            if self._exit_reason is None:
                self._exit_reason = reason
            pending = list(self._pending.values())
            streams = list(self._requests.values())
            self._pending.clear()
            self._requests.clear()
        for future in pending:
            settle(future, error=EngineProcessError(reason))
        for stream in streams:
            stream.put(CoreOutput((), (), "error", error=reason))
        if pending or streams:
            logger.error("%s; %d answers awaited and %d request streams failed", reason, len(pending), len(streams))

    def _stop_process(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._streams.close()
        self._calls.close()
