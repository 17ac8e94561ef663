"""EngineProcess: an InferenceEngine in a child process, with the engine's serving API in this one.

The scheduler thread then shares no interpreter lock with its host. In a Ray Serve replica that
host runs event loops, Ray's threads and a serializer for every streamed item; sharing one
interpreter with them, the engine's single-client steps were about a quarter slower (TPOT
through HTTP 0.093 s in the replica, 0.074 s in its own process). Here one reader thread turns
the child's per-round `deltas` messages into the same `GenerateResult` objects the in-process
engine hands out. The wire is described in `serve_app.engine_child`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

import torch

from serve_app.config import EngineConfig
from serve_app.engine_child import receive, send
from serve_app.kv.transfer import KVConfig, StoreResult
from serve_app.request import GenerateRequest, GenerateResult, StreamDelta

logger = logging.getLogger(__name__)

EXIT_WAIT_S = 30.0


class EngineProcessError(RuntimeError):
    """The engine process failed to start, or has exited."""


class EngineProcess:
    """Starts `python -m serve_app.engine_child`, waits until its engine is loaded, then serves through it."""

    def __init__(self, config: EngineConfig, start_timeout: float = 900.0) -> None:
        host_end, child_end = socket.socketpair()
        with child_end:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "serve_app.engine_child", str(child_end.fileno())],
                pass_fds=(child_end.fileno(),),
            )
        self._conn = Connection(host_end.detach())
        self._conn.send_bytes(config.model_dump_json().encode())
        info = self._wait_ready(start_timeout)
        self.max_model_len: int = info["max_model_len"]
        self.created: int = info["created"]
        self._stats: dict[str, int] = info["stats"]
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards the tables below and `_exit_reason`
        self._ids = itertools.count(1)
        self._pending: dict[int, Future] = {}  # call id -> the answer to a submit or a call
        self._results: dict[int, GenerateResult] = {}
        self._exit_reason: str | None = None
        self._reader = threading.Thread(target=self._read, name="engine-process-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._conn.poll(0.5):
                try:
                    message = receive(self._conn)
                except EOFError:
                    break
                if message[0] == "ready":
                    return message[1]
                self._stop_process()
                raise EngineProcessError(f"the engine process failed to start:\n{message[1]}")
            if self._process.poll() is not None:
                break
        self._stop_process()
        raise EngineProcessError(f"the engine process did not start (exit code {self._process.returncode})")

    # -- the serving API ----------------------------------------------------------------------
    def submit(self, request: GenerateRequest) -> GenerateResult:
        """Queue one request; raise what the engine raised if it refused it."""
        return self._submit(request).result()

    async def submit_async(self, request: GenerateRequest) -> GenerateResult:
        return await asyncio.wrap_future(self._submit(request))

    def abort(self, task_id: int) -> None:
        self._post(("abort", task_id))

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        return self._call("prompt_ids", request)

    def get_stats(self) -> dict[str, int]:
        """The engine's stats now (a round trip to its process)."""
        return self._call("get_stats")

    @property
    def latest_stats(self) -> dict[str, int]:
        """The stats the engine process last pushed: at most its STATS_EVERY_S old, no round trip."""
        with self._lock:
            if self._exit_reason is not None:
                raise EngineProcessError(self._exit_reason)
            return dict(self._stats)

    def kv_config(self) -> KVConfig:
        return self._call("kv_config")

    def kv_lookup(self, tokens: Sequence[int], cache_salt: str = "") -> int:
        return self._call("kv_lookup", list(tokens), cache_salt)

    def kv_retrieve(self, tokens: Sequence[int], cache_salt: str = "") -> torch.Tensor | None:
        return self._call("kv_retrieve", list(tokens), cache_salt)

    def kv_store_chunks(self, kv: torch.Tensor, tokens: Sequence[int], cache_salt: str = "") -> StoreResult:
        return self._call("kv_store_chunks", kv, list(tokens), cache_salt)

    @property
    def alive(self) -> bool:
        return self._process.poll() is None and self._reader.is_alive()

    def shutdown(self) -> None:
        """Stop the engine (unfinished requests end as cancelled) and wait for its process to exit."""
        try:
            self._post(("shutdown",))
        except EngineProcessError:
            pass
        try:
            self._process.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            logger.warning("the engine process did not exit in %.0f s; killing it", EXIT_WAIT_S)
            self._process.kill()
            self._process.wait()
        self._reader.join(EXIT_WAIT_S)  # it reads the last deltas, then the end of the connection
        self._conn.close()

    # -- the wire ----------------------------------------------------------------------------
    def _submit(self, request: GenerateRequest) -> Future:
        return self._request(lambda call_id: ("submit", call_id, request))

    def _call(self, method: str, *args: Any) -> Any:
        return self._request(lambda call_id: ("call", call_id, method, args)).result()

    def _request(self, message: Callable[[int], tuple]) -> Future:
        future: Future = Future()
        call_id = next(self._ids)
        with self._lock:
            if self._exit_reason is not None:
                raise EngineProcessError(self._exit_reason)
            self._pending[call_id] = future
        try:
            self._post(message(call_id))
        except EngineProcessError:
            with self._lock:
                self._pending.pop(call_id, None)
            raise
        return future

    def _post(self, message: tuple) -> None:
        try:
            with self._send_lock:
                send(self._conn, message)
        except (OSError, ValueError) as error:
            raise EngineProcessError(self._exit_reason or f"the engine process is gone ({error})") from None

    def _read(self) -> None:
        try:
            while True:
                self._dispatch(receive(self._conn))
        except (EOFError, OSError):
            pass
        except Exception:
            logger.exception("the engine process sent a message that could not be read")
        self._process.poll()
        self._fail_everything(f"the engine process exited (exit code {self._process.returncode})")

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "deltas":
            for task_id, delta in message[1]:
                self._publish(task_id, delta)
        elif kind == "accepted":
            _, call_id, task_id, prompt_tokens = message
            result = GenerateResult(task_id=task_id, prompt_tokens=prompt_tokens, _on_abandon=self._abandon)
            with self._lock:
                self._results[task_id] = result
                future = self._pending.pop(call_id)
            future.set_result(result)
        elif kind == "stats":
            with self._lock:
                self._stats = message[1]
        elif kind == "reply":
            _, call_id, ok, value = message
            with self._lock:
                future = self._pending.pop(call_id)
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

    def _publish(self, task_id: int, delta: StreamDelta) -> None:
        with self._lock:
            result = self._results.get(task_id)
            if result is not None and delta.finish_reason is not None:
                del self._results[task_id]
        if result is None:
            return
        if delta.usage is not None:  # the engine's count of prompt tokens found in the prefix cache
            result.set_cached_tokens(delta.usage.cached_tokens)
        result.publish(delta)

    def _abandon(self, task_id: int) -> None:
        try:
            self.abort(task_id)
        except EngineProcessError:
            pass  # nothing left to cancel

    def _fail_everything(self, reason: str) -> None:
        with self._lock:
            self._exit_reason = reason
            pending = list(self._pending.values())
            results = list(self._results.values())
            self._pending.clear()
            self._results.clear()
        for future in pending:
            future.set_exception(EngineProcessError(reason))
        for result in results:
            result.publish(StreamDelta("", (), "error", error=reason))
        if pending or results:
            logger.error("%s; %d requests failed", reason, len(pending) + len(results))

    def _stop_process(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._conn.close()
