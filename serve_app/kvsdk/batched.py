"""BatchedStream: many request streams run phase by phase (prefill, modify, decode), concurrently."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from serve_app.kvsdk.metrics import Metrics, StreamPerfMetrics
from serve_app.kvsdk.stream import ModifyFn, RequestStream

T = TypeVar("T")


class BatchedStream:
    """Request streams by id; each phase runs every stream at once and answers its `Metrics`."""

    def __init__(self, streams: Iterable[RequestStream] = (), max_workers: int = 64) -> None:
        self._streams: dict[str, RequestStream] = {}
        self._max_workers = max_workers
        for stream in streams:
            self.add(stream)

    def add(self, stream: RequestStream) -> str:
        self._streams[stream.request_stream_id] = stream
        return stream.request_stream_id

    def get_request_stream(self, request_stream_id: str) -> RequestStream:
        return self._streams[request_stream_id]

    def __len__(self) -> int:
        return len(self._streams)

    def prefill(self, sampling_params: Mapping[str, Any] | None = None) -> Metrics:
        """One pass of one token each: the prompts' KV gets computed and cached."""
        params = {**(sampling_params or {}), "max_tokens": 1}
        return self._run("prefill", lambda stream: stream.generate(params))

    def modify(self, fn: ModifyFn, timeout: float = 30.0, poll_interval: float = 0.2, kind: str = "kv") -> Metrics:
        return self._run("modify", lambda stream: stream.modify_kv(fn, timeout, poll_interval, kind))

    def decode(self, sampling_params: Mapping[str, Any]) -> Metrics:
        return self._run("decode", lambda stream: stream.generate(sampling_params))

    def _run(self, phase: str, work: Callable[[RequestStream], StreamPerfMetrics]) -> Metrics:
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(1, min(self._max_workers, len(self._streams)))) as pool:
            futures = {key: pool.submit(work, stream) for key, stream in self._streams.items()}
            results = {key: future.result() for key, future in futures.items()}
        return Metrics(phase, time.perf_counter() - start, results)
