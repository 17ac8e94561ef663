"""EngineLoop: the engine's thread. It owns the inbox of new tasks, aborts, calls run between steps, pages
the KV tiers delivered, step listeners and failure isolation; each round it hands the scheduler what came in,
runs the scheduler's batch through the model step, and tells the listeners."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import TypeVar

from serve_app.engine.scheduler import Batch, Scheduler
from serve_app.engine.step import ModelStep
from serve_app.engine.task import Task, TaskState
from serve_app.kv.tiers.pages import LoadedPages
from serve_app.wire.outputs import CoreOutput
from serve_app.wire.refusals import EngineOverloadedError

logger = logging.getLogger(__name__)

T = TypeVar("T")

# What a client is told of a step that failed for its request; what failed is the engine's log's, not the client's.
STEP_FAILED = "the engine failed while running this request (its log says why)"


class EngineLoop:
    """Only its thread touches tasks and the cache; every other method may be called from any thread."""

    def __init__(self, scheduler: Scheduler, step: ModelStep) -> None:
        self.scheduler = scheduler
        self.step = step
        self.config = scheduler.config
        self._inbox: list[Task] = []
        self._aborts: set[int] = set()
        self._calls: list[tuple[Callable[[], object], Future]] = []
        self._loaded: list[LoadedPages] = []
        self._step_listeners: list[Callable[[], None]] = []
        self._wake = threading.Condition()
        self._stopped = False
        self._failed_steps = 0  # in a row: a step whose requests all failed, even one by one
        self._thread = threading.Thread(target=self._loop, name="inference-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        """Alive, and fewer than `max_consecutive_failed_steps` steps in a row have failed every request."""
        return self.alive and self._failed_steps < self.config.max_consecutive_failed_steps

    def add_step_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` on the loop's thread after every round, and once when it stops.

        A round is the cancellations, calls and step since the last one: a listener can ship
        everything they published in one go.
        """
        self._step_listeners.append(listener)

    def deliver_loaded(self, loaded: LoadedPages) -> None:
        """Pages the KV tiers read for a waiting task (from a tier loader thread)."""
        with self._wake:
            self._loaded.append(loaded)
            self._wake.notify()

    def submit(self, task: Task) -> None:
        """Queue a task; EngineOverloadedError when `max_waiting_requests` are already waiting."""
        with self._wake:
            if self._stopped:
                raise RuntimeError("the engine has shut down")
            if self._num_waiting() >= self.config.max_waiting_requests:
                raise EngineOverloadedError(
                    f"the engine is overloaded: max_waiting_requests={self.config.max_waiting_requests} are waiting"
                )
            self._inbox.append(task)
            self.scheduler.stats.total_tasks += 1
            self._wake.notify()

    def abort(self, task_id: int) -> None:
        with self._wake:
            self._aborts.add(task_id)
            self._wake.notify()

    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run `fn` on the loop's thread between two steps (where the cache may be touched); return its result.

        At most `max_pending_calls` wait at once (EngineOverloadedError past that). A call still
        waiting after `timeout` (default `call_timeout_s`) raises TimeoutError and is never run.
        """
        future: Future = Future()
        entry = (fn, future)
        with self._wake:
            if self._stopped:
                raise RuntimeError("the engine has shut down")
            if len(self._calls) >= self.config.max_pending_calls:
                raise EngineOverloadedError(
                    f"the engine is overloaded: max_pending_calls={self.config.max_pending_calls} calls are waiting"
                )
            self._calls.append(entry)
            self._wake.notify()
        try:
            return future.result(self.config.call_timeout_s if timeout is None else timeout)
        except FutureTimeoutError:
            with self._wake:
                if entry in self._calls:
                    self._calls.remove(entry)
            if future.cancel():
                raise TimeoutError("the engine did not take the call in time; it will not run") from None
            return future.result()  # it has started: its answer comes soon

    def counts(self) -> tuple[int, int]:
        """(running, waiting) right now."""
        with self._wake:
            return len(self.scheduler.running), self._num_waiting()

    def _num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._inbox) + self.scheduler.num_loading

    # -- the thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        scheduler = self.scheduler
        while True:
            with self._wake:
                self._wake.wait_for(
                    lambda: self._stopped or self._inbox or self._aborts or self._calls or self._loaded
                    or scheduler.running or scheduler.waiting
                )
                if self._stopped:
                    break
                scheduler.add(self._inbox)
                self._inbox.clear()
                aborts, self._aborts = self._aborts, set()
                calls, self._calls = self._calls, []
                loaded, self._loaded = self._loaded, []
            scheduler.take_loaded(loaded)
            scheduler.cancel(aborts)
            for fn, future in calls:
                _run_into(fn, future)
            scheduler.offload()  # what the calls published (a KV store), before a step can evict it
            try:
                self._round()
            except Exception:  # a failed round must not stop the loop; its tasks fail instead
                logger.exception("engine step failed")
                self._failed_steps += 1
                scheduler.fail_running(STEP_FAILED)
            scheduler.offload()
            self._notify_step_listeners()
        with self._wake:
            inbox, self._inbox = self._inbox, []
        scheduler.cancel_all(also=inbox)
        self._notify_step_listeners()
        with self._wake:
            for _, future in self._calls:
                future.set_exception(RuntimeError("the engine has shut down"))
            self._calls.clear()

    def _round(self) -> None:
        """The scheduler's batch through the model. If it fails, its requests run again one by one, so that
        only the ones that fail alone end with an error and the others go on."""
        batch = self.scheduler.schedule()
        if batch is None:
            return
        lengths = [task.num_tokens for task in batch.tasks]
        started = time.perf_counter()
        try:
            self.step.run(batch)
        except Exception:
            logger.exception("engine step failed; running its %d requests one by one", len(batch.tasks))
            if self._run_each(batch, lengths):
                return
            self._failed_steps += 1
            if not self.healthy:
                logger.error("%d steps in a row failed every request: this engine reports itself unhealthy", self._failed_steps)
            return
        self._failed_steps = 0
        self.scheduler.ran(batch, time.perf_counter() - started)

    def _run_each(self, batch: Batch, lengths: list[int]) -> bool:
        """Run each entry alone; a task that fails alone ends with an error. True if any ran."""
        ran = False
        for single, length in zip(batch.alone(), lengths):
            task = single.tasks[0]
            if task.state is TaskState.FINISHED or task.num_tokens != length:
                continue  # it finished, or it took its token before the failure
            try:
                self.step.run(single)
                ran = True
            except Exception:
                logger.exception("task %d failed", task.task_id)
                self.scheduler.finish(task, CoreOutput((), (), "error", error=STEP_FAILED))
        if ran:
            self._failed_steps = 0
        return ran

    def _notify_step_listeners(self) -> None:
        for listener in self._step_listeners:
            try:
                listener()
            except Exception:
                logger.exception("a step listener failed")


def _run_into(fn: Callable[[], object], future: Future) -> None:
    """Run `fn`, handing its result or exception to `future`."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as error:  # the caller re-raises it
        future.set_exception(error)
