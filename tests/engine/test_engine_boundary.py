"""The engine's boundary under stress: slow submits, held-up KV replies, failing steps, full queues.

The engine process's side (`EngineChild`) runs here in a thread over real socket pairs, so a
test can hold up one channel and watch the other.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from serve_app.engine.child import EngineChild
from serve_app.engine.engine import InferenceEngine
from serve_app.engine.messages import (
    Accepted,
    Call,
    Health,
    Outputs,
    PagesChanged,
    Ready,
    Reply,
    Shutdown,
    Submit,
    receive,
    send,
)
from serve_app.kv.prefix_cache import page_hashes
from serve_app.wire.calls import RetrieveKV
from serve_app.wire.page_events import PageEventBatch
from serve_app.wire.refusals import EngineOverloadedError
from serve_app.wire.requests import EncodedRequest, GenerateRequest

OPTIONS = dict(kv_cache="paged", page_size=16, cache_tokens=4096, max_model_len=512)
LONG_PROMPT = list(range(1, 449))  # 28 pages: its KV is far bigger than the call channel's socket buffer


def _greedy(prompt: list[int], max_tokens: int = 12, client_salt: str = "") -> EncodedRequest:
    """A greedy request of token ids, as the engine runs it (its client's salt its tenant salt, as in process)."""
    request = GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return EncodedRequest(request, prompt, client_salt)


class ChildOverSockets:
    """An `EngineChild` serving in a thread; the test holds the host's ends of both channels."""

    def __init__(self, engine: InferenceEngine) -> None:
        stream_host, stream_child = socket.socketpair()
        call_host, call_child = socket.socketpair()
        for end in (call_host, call_child):  # small buffers: a KV reply cannot fit in them
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.streams = Connection(stream_host.detach())
        self.calls = Connection(call_host.detach())
        self.page_events: list[PageEventBatch] = []  # what `next_stream_message` passed over
        child = EngineChild(engine, Connection(stream_child.detach()), Connection(call_child.detach()))
        self.thread = threading.Thread(target=child.serve, daemon=True)
        self.thread.start()
        assert isinstance(receive(self.streams), Ready)

    def next_stream_message(self, timeout: float) -> object:
        """The next message about requests (page events, which come after any round that cached pages, apart)."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.streams.poll(max(0.0, deadline - time.monotonic())):
                raise AssertionError(f"nothing on the stream channel for {timeout} s")
            message = receive(self.streams)
            if not isinstance(message, PagesChanged):
                return message
            self.page_events.append(message.batch)

    def finish_of(self, call_id: int, timeout: float = 30.0) -> tuple[int, list[int]]:
        """Read the stream channel until the request of `call_id` has been accepted and has finished: (task id,
        its tokens). Its outputs carry the call id, and may come before its `Accepted`."""
        deadline = time.monotonic() + timeout
        task_id, tokens, finished = None, [], False
        while time.monotonic() < deadline:
            message = self.next_stream_message(deadline - time.monotonic())
            if isinstance(message, Accepted) and message.call_id == call_id:
                task_id = message.task_id
            if isinstance(message, Outputs):
                for call, output in message.items:
                    if call == call_id:
                        tokens.extend(output.token_ids)
                        finished = finished or output.finish_reason is not None
            if finished and task_id is not None:
                return task_id, tokens
        raise AssertionError(f"request {call_id} did not finish in {timeout} s")

    def close(self) -> None:
        send(self.streams, Shutdown())
        self.thread.join(30)


@pytest.fixture
def engine(tiny_llama_path: Path) -> Iterator[InferenceEngine]:
    eng = InferenceEngine(compile=False, model=str(tiny_llama_path), **OPTIONS)
    yield eng
    eng.shutdown()


def test_streams_keep_flowing_while_a_kv_reply_waits_to_be_read(engine: InferenceEngine) -> None:
    child = ChildOverSockets(engine)
    try:
        send(child.streams, Submit(1, _greedy(LONG_PROMPT, 1)))
        child.finish_of(1)
        send(child.calls, Call(2, RetrieveKV(LONG_PROMPT)))  # its reply is never read until the end
        time.sleep(0.5)  # the engine has started sending it and is blocked
        send(child.streams, Submit(3, _greedy([5, 6, 7], 30)))
        _, tokens = child.finish_of(3)
        assert len(tokens) == 30
        reply = receive(child.calls)
        assert isinstance(reply, Reply) and reply.ok and reply.value.shape[2] == len(LONG_PROMPT)
    finally:
        child.close()


def test_streams_keep_flowing_while_a_submit_is_checked(engine: InferenceEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    checking = threading.Event()
    release = threading.Event()
    make_task = engine.intake.task

    def slow_task(encoded, *args):  # a chat's, as a grammar's compile would be
        if encoded.request.messages is not None:
            checking.set()
            assert release.wait(30)
        return make_task(encoded, *args)

    monkeypatch.setattr(engine.intake, "task", slow_task)
    child = ChildOverSockets(engine)
    try:
        send(child.streams, Submit(1, _greedy([5, 6, 7], 40)))
        assert isinstance(child.next_stream_message(30), Accepted)
        chat = GenerateRequest(messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0)
        send(child.streams, Submit(2, engine.encode(chat)))
        assert checking.wait(30)
        # The first request finishes while the second is still being checked (the engine's stats
        # go out on the same channel every HEALTH_EVERY_S while they change).
        deltas = 0
        while True:
            message = child.next_stream_message(30)
            if isinstance(message, Health):
                continue
            assert isinstance(message, Outputs), message
            deltas += 1
            if any(output.finish_reason for _, output in message.items):
                break
        assert deltas > 1 and not release.is_set()
        release.set()
        child.finish_of(2)
    finally:
        release.set()
        child.close()


def test_steps_that_keep_failing_make_the_engine_report_itself_unhealthy(
    engine: InferenceEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert engine.healthy
    child = ChildOverSockets(engine)

    def broken_forward(batch, view):
        raise RuntimeError("injected sticky device error")

    monkeypatch.setattr(engine.runner, "forward", broken_forward)
    try:
        for call_id in range(1, 4):
            send(child.streams, Submit(call_id, _greedy([5, 6, 7], 4)))
            child.finish_of(call_id)
        assert not engine.healthy
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            message = child.next_stream_message(deadline - time.monotonic())
            if isinstance(message, Health) and not message.healthy:
                break
        else:
            raise AssertionError("the engine process never reported itself unhealthy")
    finally:
        child.close()


def test_one_failed_step_among_good_ones_keeps_the_engine_healthy(
    engine: InferenceEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    forward = engine.runner.forward
    failures = iter([True, False, True, False, True, False])

    def sometimes_failing(batch, view):
        if next(failures, False):
            raise RuntimeError("injected one-off error")
        return forward(batch, view)

    monkeypatch.setattr(engine.runner, "forward", sometimes_failing)
    for _ in range(3):
        engine.add_request(_greedy([5, 6, 7], 1)).wait(30)
    assert engine.healthy


def test_past_max_waiting_requests_a_submit_is_refused(tiny_llama_path: Path) -> None:
    engine = InferenceEngine(compile=False, model=str(tiny_llama_path), max_num_seqs=1, max_waiting_requests=2, **OPTIONS)
    try:
        running = engine.add_request(_greedy([5, 6, 7], 400))
        while engine.get_stats()["active_tasks"] == 0:
            time.sleep(0.01)
        waiting = [engine.add_request(_greedy([8, 9], 2)) for _ in range(2)]
        with pytest.raises(EngineOverloadedError, match="max_waiting_requests=2"):
            engine.add_request(_greedy([8, 9], 2))
        engine.abort(running.task_id)
        assert running.wait(30).finish_reason == "cancelled"
        assert [r.wait(30).finish_reason for r in waiting] == ["length", "length"]
    finally:
        engine.shutdown()


def test_calls_are_bounded_and_one_that_timed_out_never_runs(tiny_llama_path: Path) -> None:
    engine = InferenceEngine(compile=False, model=str(tiny_llama_path), max_pending_calls=2, **OPTIONS)
    scheduler = engine.loop
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def blocking() -> None:
        started.set()
        release.wait(30)

    try:
        blocker = threading.Thread(target=scheduler.call, args=(blocking,))
        blocker.start()
        assert started.wait(30)  # the scheduler thread is inside `blocking` now
        with pytest.raises(TimeoutError, match="will not run"):
            scheduler.call(lambda: ran.append("late"), timeout=0.2)
        waiters = [threading.Thread(target=scheduler.call, args=(lambda: ran.append("queued"),)) for _ in range(2)]
        for waiter in waiters:
            waiter.start()
        deadline = time.monotonic() + 10
        while len(scheduler._calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(EngineOverloadedError, match="max_pending_calls=2"):
            scheduler.call(lambda: ran.append("refused"))
        release.set()
        for thread in [blocker, *waiters]:
            thread.join(30)
        assert ran == ["queued", "queued"]
    finally:
        release.set()
        engine.shutdown()


def test_the_engine_process_reports_the_pages_it_caches(engine: InferenceEngine) -> None:
    child = ChildOverSockets(engine)
    try:
        send(child.streams, Submit(1, _greedy(LONG_PROMPT, 1, client_salt="events")))
        child.finish_of(1)
        expected = set(page_hashes(LONG_PROMPT, engine.kv.config().page_size, "events"))
        deadline = time.monotonic() + 10
        held: set = set()
        while not expected <= held and time.monotonic() < deadline:
            for batch in child.page_events:
                held = batch.applied_to(held)
            child.page_events.clear()
            try:
                child.next_stream_message(0.2)
            except AssertionError:  # nothing else to read: the events may be all there
                pass
        assert expected <= held
    finally:
        child.close()
