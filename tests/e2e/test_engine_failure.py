"""The engine replica dies mid-stream (its process killed) under a real `serve run`.

Clients get an error event, not a hang; the replica's engine process exits with it; `/health`
says not ready until Ray Serve has brought a replica back; then requests succeed again.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import psutil

from serve_app.bench.servers import ServeRun
from tests.served import engine_replica_pid

MODEL = "smollm2-135m-instruct"


def _wait_exited(process: psutil.Process, timeout: float) -> None:
    """Until `process` has exited (a zombie waiting for whoever adopted it counts as exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.2)
    raise AssertionError(f"process {process.pid} still running after {timeout} s")


def _wait_health(served: ServeRun, status: int, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{served.url}/health", timeout=5).status_code == status:
                return time.monotonic()
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"/health did not answer {status} within {timeout} s")


def test_killed_engine_replica_fails_streams_then_comes_back(served: ServeRun) -> None:
    body = {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 900, "ignore_eos": True, "stream": True}
    events: list[dict] = []
    killed = False
    engine_processes: list[psutil.Process] = []
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 3 and not killed:
                replica = psutil.Process(engine_replica_pid(served.process.pid))
                engine_processes = [p for p in replica.children() if "deployments.engine_child" in " ".join(p.cmdline())]
                os.kill(replica.pid, signal.SIGKILL)
                killed = True
    assert killed and "error" in events[-1], events[-3:]
    assert "failed" in events[-1]["error"]["message"]
    assert len(engine_processes) == 1
    _wait_exited(engine_processes[0], timeout=60)
    _wait_health(served, 503, timeout=30)
    down = httpx.post(f"{served.url}/v1/completions", json={**body, "stream": False, "max_tokens": 2}, timeout=60)
    assert down.status_code in (200, 503)  # 200 only if the new replica was already up
    _wait_health(served, 200, timeout=180)
    again = httpx.post(
        f"{served.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4}, timeout=120
    )
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] >= 1
