"""The engine's own process: an InferenceEngine served over one connection to its host.

`python -m serve_app.engine_child FD` is started by `EngineProcess` with one end of a socket
pair as FD. It reads the `EngineConfig` (JSON bytes), loads the engine, answers `("ready",
info)` or `("failed", reason)`, then serves these messages until the host says `shutdown` or
goes away:

    host -> engine                               engine -> host
    ("submit", call_id, GenerateRequest)         ("accepted", call_id, task_id, prompt_tokens)
                                                 or ("reply", call_id, False, error)
    ("abort", task_id)
    ("call", call_id, method, args)              ("reply", call_id, ok, value or error)
    ("shutdown",)
                                                 ("deltas", [(task_id, StreamDelta), ...])
                                                 ("stats", get_stats())

Every delta a scheduler round published goes out in one `deltas` message after that round.
The engine's stats go out every STATS_EVERY_S when they have changed (the ready message
carries the first), so a host's stats reporter needs no round trip.
A request's `accepted` is always sent before its first delta. Messages are plain pickles (not
multiprocessing's, which would move tensors to shared memory): `send` and `receive`.
"""

from __future__ import annotations

import logging
import pickle
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from serve_app.config import EngineConfig
from serve_app.engine import InferenceEngine
from serve_app.request import GenerateRequest, StreamDelta

logger = logging.getLogger(__name__)

# The engine methods a host may call by name.
CALLS = frozenset({"prompt_ids", "get_stats", "kv_config", "kv_lookup", "kv_retrieve", "kv_store_chunks"})
STATS_EVERY_S = 0.2


class EngineChild:
    """Relays one connection to an engine: requests in, one message of deltas per scheduler round out."""

    def __init__(self, engine: InferenceEngine, conn: Connection) -> None:
        self.engine = engine
        self._conn = conn
        self._send_lock = threading.Lock()
        self._outbox: list[tuple[int, StreamDelta]] = []
        self._outbox_lock = threading.Lock()
        # KV calls wait for the scheduler; they must not hold up submits and aborts.
        self._calls = ThreadPoolExecutor(max_workers=2, thread_name_prefix="engine-call")
        self._pushed_stats = engine.get_stats()
        engine.scheduler.add_step_listener(self._flush)

    def serve(self) -> None:
        """Handle messages until `shutdown`, the host's end closing, or the scheduler dying."""
        info = {"max_model_len": self.engine.max_model_len, "created": self.engine.created, "stats": self._pushed_stats}
        self._send(("ready", info))
        next_stats = time.monotonic() + STATS_EVERY_S
        try:
            while True:
                if self._conn.poll(max(0.0, next_stats - time.monotonic())):
                    message = receive(self._conn)
                    if message[0] == "shutdown":
                        return
                    self._handle(message)
                if time.monotonic() >= next_stats:
                    if not self.engine.scheduler.alive:
                        logger.error("the scheduler thread has stopped; exiting")
                        return
                    self._push_stats()
                    next_stats = time.monotonic() + STATS_EVERY_S
        except (EOFError, OSError):
            logger.info("the host closed the connection; exiting")
        finally:
            self.engine.shutdown()
            self._calls.shutdown(wait=False, cancel_futures=True)
            self._flush()

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "submit":
            self._submit(message[1], message[2])
        elif kind == "abort":
            self.engine.abort(message[1])
        elif kind == "call":
            _, call_id, method, args = message
            self._calls.submit(self._call, call_id, method, args)
        else:
            logger.error("unknown message %r", kind)

    def _submit(self, call_id: int, request: GenerateRequest) -> None:
        # Holding the send lock until `accepted` is out keeps the request's deltas behind it.
        with self._send_lock:
            try:
                result = self.engine.submit(request)
            except Exception as error:
                send(self._conn, ("reply", call_id, False, portable(error)))
                return
            task_id = result.task_id
            result.subscribe(lambda delta: self._post(task_id, delta))
            send(self._conn, ("accepted", call_id, task_id, result.prompt_tokens))
        self._flush()  # deltas published before the subscription have no scheduler round left to ship them

    def _call(self, call_id: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            if method not in CALLS:
                raise ValueError(f"unknown engine call {method!r}")
            answer = ("reply", call_id, True, getattr(self.engine, method)(*args))
        except Exception as error:
            answer = ("reply", call_id, False, portable(error))
        try:
            self._send(answer)
        except (OSError, ValueError):
            pass  # the host has gone

    def _push_stats(self) -> None:
        stats = self.engine.get_stats()
        if stats != self._pushed_stats:
            self._pushed_stats = stats
            self._send(("stats", stats))

    def _post(self, task_id: int, delta: StreamDelta) -> None:
        with self._outbox_lock:
            self._outbox.append((task_id, delta))

    def _flush(self) -> None:
        with self._outbox_lock:
            deltas, self._outbox = self._outbox, []
        if deltas:
            try:
                self._send(("deltas", deltas))
            except (OSError, ValueError):
                pass  # the host has gone; the serve loop notices and stops

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            send(self._conn, message)


def send(conn: Connection, message: tuple) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> tuple:
    return pickle.loads(conn.recv_bytes())


def portable(error: Exception) -> Exception:
    """`error` if it pickles (the host re-raises it as it is), else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def main(fd: int) -> None:
    logging.basicConfig(level=logging.INFO, format="engine process %(levelname)s %(name)s: %(message)s")
    conn = Connection(fd)
    try:
        config = EngineConfig.model_validate_json(conn.recv_bytes())
        engine = InferenceEngine(config=config)
    except BaseException:
        send(conn, ("failed", traceback.format_exc()))
        raise
    EngineChild(engine, conn).serve()


if __name__ == "__main__":
    main(int(sys.argv[1]))
