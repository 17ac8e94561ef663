"""The engine's own process: an InferenceEngine served over two connections to its host.

`python -m serve_app.engine.child STREAM_FD CALL_FD` is started by `EngineProcess` with one end
of two socket pairs. It reads the `EngineConfig` (JSON bytes) on the stream channel, loads the
engine, answers `Ready` or `Failed`, then serves the messages of `serve_app.engine.messages`
until the host says `Shutdown` or goes away.

Every send on the stream channel is small (an acceptance, one round's outputs, the stats), so the
scheduler's per-round flush never waits behind a tokenization or a KV transfer: requests are
tokenized (and their grammars compiled) by their own threads, and calls (KV tensors of up to a
gigabyte) are answered on the call channel by theirs. The engine's stats and health go out every
HEALTH_EVERY_S when they have changed, so a host's stats reporter needs no round trip.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

from serve_app.config import EngineConfig
from serve_app.engine.engine import InferenceEngine
from serve_app.engine.messages import (
    Abort,
    Accepted,
    Call,
    Failed,
    FromEngine,
    Health,
    Outputs,
    PagesChanged,
    Ready,
    Refused,
    Reply,
    ResendPages,
    Shutdown,
    Submit,
    Withdraw,
    portable,
    receive,
    send,
)
from serve_app.kv.tiers.tier_chain import RayTiers
from serve_app.wire.outputs import CoreOutput
from serve_app.wire.refusals import EngineOverloadedError

logger = logging.getLogger(__name__)

HEALTH_EVERY_S = 0.2


class EngineChild:
    """Relays the host's messages to an engine: requests in, one message of token outputs per scheduler round out.

    Each task's outputs go straight into the outbox, keyed by the id of the host's submit call.
    """

    def __init__(self, engine: InferenceEngine, streams: Connection, calls: Connection) -> None:
        self.engine = engine
        self._streams = streams
        self._calls = calls
        self._stream_lock = threading.Lock()
        self._call_lock = threading.Lock()
        self._outbox: list[tuple[int, CoreOutput]] = []
        self._outbox_lock = threading.Lock()
        # Calls wait for the scheduler; they must not hold up submits, aborts or each other's replies.
        self._max_calls = engine.config.scheduler.max_pending_calls
        self._call_workers = ThreadPoolExecutor(max_workers=self._max_calls, thread_name_prefix="engine-call")
        # Submits may tokenize: off the reader, so aborts are read meanwhile. Those that compile a grammar wait on
        # threads of their own (as many as may wait for a compile), so that they never hold up the others.
        self._submitters = ThreadPoolExecutor(max_workers=2, thread_name_prefix="engine-submit")
        self._max_compiling = engine.config.grammar.max_pending_compiles
        self._constrained = ThreadPoolExecutor(max_workers=self._max_compiling, thread_name_prefix="engine-submit-grammar")
        self._withdrawals: dict[int, threading.Event] = {}  # call id -> set when its caller has gone
        self._withdrawals_lock = threading.Lock()
        self._calls_in_flight = threading.BoundedSemaphore(self._max_calls)
        self._pushed = Health(engine.get_stats(), engine.healthy)
        engine.loop.add_step_listener(self._flush)
        self._page_events = engine.record_page_events()
        if self._page_events is not None:
            engine.loop.add_step_listener(self._send_page_events)

    def serve(self) -> None:
        """Handle messages until `Shutdown`, the host's end closing, or the scheduler dying."""
        engine = self.engine
        self._send_stream(
            Ready(
                str(engine.runner.path), engine.max_model_len, engine.created, engine.tool_format, engine.reasoning_parser, engine.vocab_size,
                engine.hidden_size, self._pushed.stats,
            )
        )
        threading.Thread(target=self._read_calls, name="engine-call-reader", daemon=True).start()
        next_health = time.monotonic() + HEALTH_EVERY_S
        try:
            while True:
                if self._streams.poll(max(0.0, next_health - time.monotonic())):
                    message = receive(self._streams)
                    if isinstance(message, Shutdown):
                        return
                    self._handle(message)
                if time.monotonic() >= next_health:
                    if not self.engine.loop.alive:
                        logger.error("the engine loop's thread has stopped; exiting")
                        return
                    self._push_health()
                    next_health = time.monotonic() + HEALTH_EVERY_S
        except (EOFError, OSError):
            logger.info("the host closed the connection; exiting")
        finally:
            with self._withdrawals_lock:
                waiting = list(self._withdrawals.values())
            for withdrawn in waiting:
                withdrawn.set()  # compiles' waiters give up, so the pools shut down at once
            self._submitters.shutdown(wait=True, cancel_futures=True)
            self._constrained.shutdown(wait=True, cancel_futures=True)
            self.engine.shutdown()
            self._call_workers.shutdown(wait=False, cancel_futures=True)
            self._flush()

    def _handle(self, message: Submit | Abort | Withdraw | ResendPages) -> None:
        match message:
            case Submit(call_id, request):
                if request.request.structured_output is None:
                    self._submitters.submit(self._submit, message)
                    return
                with self._withdrawals_lock:
                    if len(self._withdrawals) >= self._max_compiling:
                        overloaded = EngineOverloadedError(
                            f"the engine is overloaded: max_pending_compiles={self._max_compiling} requests wait for a grammar"
                        )
                        self._send_stream(Refused(call_id, overloaded))
                        return
                    withdrawn = self._withdrawals[call_id] = threading.Event()
                self._constrained.submit(self._submit, message, withdrawn)
            case Withdraw(call_id):
                with self._withdrawals_lock:
                    withdrawn = self._withdrawals.get(call_id)
                if withdrawn is not None:
                    withdrawn.set()
            case Abort(task_id):
                self.engine.abort(task_id)
            case ResendPages():
                if self._page_events is not None:
                    self._page_events.snapshot_next()
            case _:
                logger.error("unknown message %r", message)

    def _submit(self, message: Submit, withdrawn: threading.Event | None = None) -> None:
        call_id = message.call_id
        try:  # compiles a grammar: no lock held
            task = self.engine.queue(
                message.request, lambda _, output: self._post(call_id, output), withdrawn.is_set if withdrawn else lambda: False
            )
        except Exception as error:
            self._send_stream(Refused(call_id, portable(error)))
            return
        finally:
            if withdrawn is not None:
                with self._withdrawals_lock:
                    del self._withdrawals[call_id]
        # Its outputs are keyed by the call id the host already waits on, so they may go out before this.
        self._send_stream(Accepted(call_id, task.task_id))

    def _read_calls(self) -> None:
        try:
            while True:
                message: Call = receive(self._calls)
                if not self._calls_in_flight.acquire(blocking=False):
                    overloaded = EngineOverloadedError(f"the engine is overloaded: max_pending_calls={self._max_calls}")
                    self._send_reply(Reply(message.call_id, False, overloaded))
                    continue
                self._call_workers.submit(self._answer, message)
        except (EOFError, OSError, RuntimeError):  # the host has gone, or the workers have shut down
            pass

    def _answer(self, message: Call) -> None:
        try:
            reply = Reply(message.call_id, True, self.engine.answer(message.call))
        except Exception as error:
            reply = Reply(message.call_id, False, portable(error))
        try:
            self._send_reply(reply)
        finally:
            self._calls_in_flight.release()

    def _send_reply(self, reply: Reply) -> None:
        try:
            with self._call_lock:
                send(self._calls, reply)
        except (OSError, ValueError):
            pass  # the host has gone

    def _push_health(self) -> None:
        health = Health(self.engine.get_stats(), self.engine.healthy)
        if health != self._pushed:
            self._pushed = health
            self._send_stream(health)

    def _post(self, call_id: int, output: CoreOutput) -> None:
        """A task's output, on the scheduler thread: into the outbox that goes out once the round is over."""
        with self._outbox_lock:
            self._outbox.append((call_id, output))

    def _flush(self) -> None:
        with self._outbox_lock:
            outputs, self._outbox = self._outbox, []
        if outputs:
            try:
                self._send_stream(Outputs(outputs))
            except (OSError, ValueError):
                pass  # the host has gone; the serve loop notices and stops

    def _send_page_events(self) -> None:
        assert self._page_events is not None
        batch = self._page_events.drain()
        if batch:
            try:
                self._send_stream(PagesChanged(batch))
            except (OSError, ValueError):
                pass  # the host has gone

    def _send_stream(self, message: FromEngine) -> None:
        with self._stream_lock:
            send(self._streams, message)


def main(stream_fd: int, call_fd: int, ray_tiers: RayTiers | None = None) -> None:
    """Serve an engine over the two connections; `ray_tiers` builds the KV tiers kept in Ray, where the config
    names any (`python -m deployments.engine_child` hands them)."""
    logging.basicConfig(level=logging.INFO, format="engine process %(levelname)s %(name)s: %(message)s")
    streams, calls = Connection(stream_fd), Connection(call_fd)
    try:
        config = EngineConfig.model_validate_json(streams.recv_bytes())
        engine = InferenceEngine(config=config, ray_tiers=ray_tiers)
    except BaseException:
        send(streams, Failed(traceback.format_exc()))
        raise
    EngineChild(engine, streams, calls).serve()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
