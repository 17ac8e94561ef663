"""The host's side of the channels to the engine process: waiting for its engine to be ready, a writer thread per
channel that sends its messages in order (a caller only queues them), and settling a caller's future unless the
caller has gone."""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from serve_app.engine.messages import Failed, Ready, ToEngine, receive, send


class EngineProcessError(RuntimeError):
    """The engine process failed to start, or has exited."""


def wait_ready(conn: Connection, process: subprocess.Popen, timeout: float) -> Ready:
    """The child's `Ready`, once its engine has loaded; EngineProcessError if it fails, exits or takes longer than
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if conn.poll(0.5):
            try:
                message = receive(conn)
            except EOFError:
                break
            if isinstance(message, Ready):
                return message
            reason = message.reason if isinstance(message, Failed) else repr(message)
            raise EngineProcessError(f"the engine process failed to start:\n{reason}")
        if process.poll() is not None:
            break
    code = process.poll()
    if code is None:
        raise EngineProcessError(f"the engine process did not start within {timeout:g} s")
    raise EngineProcessError(f"the engine process did not start (exit code {code})")


class ChannelWriter:
    """Sends one channel's messages from its own thread, in the order they were queued."""

    def __init__(self, conn: Connection, name: str, on_broken: Callable[[str], None]) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[ToEngine | None] = queue.SimpleQueue()
        self._on_broken = on_broken
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, message: ToEngine) -> None:
        """Queue `message`; never blocks."""
        self._queue.put(message)

    def close(self, wait_s: float) -> None:
        """Send what is queued, then stop (waiting `wait_s` at most)."""
        self._queue.put(None)
        self._thread.join(wait_s)

    def _run(self) -> None:
        while (message := self._queue.get()) is not None:
            try:
                send(self._conn, message)
            except (OSError, ValueError) as error:
                self._on_broken(f"the engine process is gone ({error})")
                return


def settle(future: Future, value: Any = None, error: BaseException | None = None) -> bool:
    """Give `future` its answer unless its caller cancelled it; False when it was cancelled."""
    if not future.set_running_or_notify_cancel():
        return False
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
    return True
