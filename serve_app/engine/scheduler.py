"""InferenceScheduler: the continuous-batching loop in a daemon thread.

Each step frees finished and cancelled tasks, makes room for every running decode (preempting
the newest task by recompute when pages run out), admits waiting tasks while memory lasts,
packs all decode tokens (with their proposed tokens, under speculative decoding) and prefill
chunks into one batch, runs the model once, samples, and publishes each task's delta.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import TypeVar

import torch

from serve_app.config import SchedulerConfig
from serve_app.engine.emitting import TokenEmitter
from serve_app.engine.grammar import GrammarCompiler
from serve_app.engine.request import StreamDelta
from serve_app.engine.speculation import Speculator
from serve_app.engine.task import Task, TaskState
from serve_app.engine.tier_loading import TierLoading
from serve_app.errors import EngineOverloadedError
from serve_app.kv.base import KVCache
from serve_app.kv.tiers.pages import LoadedPages
from serve_app.kv.view import BatchEntry
from serve_app.model.runner import ForwardBatch, ModelRunner

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class SchedulerStats:
    total_tasks: int = 0
    total_tokens: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    prefix_cache_queried_tokens: int = 0  # tokens looked up in the prefix cache at each admission
    prefix_cache_hit_tokens: int = 0  # of those, tokens found there (in the pool or a KV tier)
    preemptions: int = 0
    steps: int = 0


class InferenceScheduler:
    """Owns the waiting queue and the running set; only its thread touches tasks and the cache."""

    def __init__(
        self,
        runner: ModelRunner,
        cache: KVCache,
        config: SchedulerConfig,
        max_model_len: int,
        grammars: GrammarCompiler,
        speculator: Speculator | None = None,
    ) -> None:
        self.runner = runner
        self.cache = cache
        self.config = config
        self.max_model_len = max_model_len
        self.emitter = TokenEmitter(grammars, runner.tokenizer.decode, max_model_len)
        self.speculator = speculator
        self.stats = SchedulerStats()
        self.waiting: deque[Task] = deque()
        self.running: list[Task] = []
        self._inbox: list[Task] = []
        self._aborts: set[int] = set()
        self._calls: list[tuple[Callable[[], object], Future]] = []
        self.tiers: TierLoading | None = None  # the KV tiers behind a paged cache, when configured
        self._loaded: list[LoadedPages] = []
        self._step_listeners: list[Callable[[], None]] = []
        self._wake = threading.Condition()
        self._stopped = False
        self._failed_steps = 0  # in a row: a step whose requests all failed, even one by one
        self._thread = threading.Thread(target=self._loop, name="inference-scheduler", daemon=True)

    # -- called from any thread -------------------------------------------------------------
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
        """Call `listener()` on the scheduler thread after every round of the loop, and once when it stops.

        A round is the cancellations, calls and step since the last one: a listener can ship
        everything they published in one go.
        """
        self._step_listeners.append(listener)

    def deliver_loaded(self, loaded: LoadedPages) -> None:
        """Pages the KV tiers read for a waiting task (from a tier loader thread)."""
        with self._wake:
            self._loaded.append(loaded)
            self._wake.notify()

    def _num_waiting(self) -> int:
        return len(self.waiting) + len(self._inbox) + (len(self.tiers.loading) if self.tiers is not None else 0)

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
            self.stats.total_tasks += 1
            self._wake.notify()

    def abort(self, task_id: int) -> None:
        with self._wake:
            self._aborts.add(task_id)
            self._wake.notify()

    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run `fn` on the scheduler thread between two steps (where the cache may be touched); return its result.

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
            return len(self.running), self._num_waiting()

    # -- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(
                    lambda: self._stopped or self._inbox or self._aborts or self._calls or self._loaded or self.running
                    or self.waiting
                )
                if self._stopped:
                    break
                self.waiting.extend(self._inbox)
                self._inbox.clear()
                aborts, self._aborts = self._aborts, set()
                calls, self._calls = self._calls, []
                loaded, self._loaded = self._loaded, []
            self._take_loaded(loaded)
            self._cancel(aborts)
            for fn, future in calls:
                _run_into(fn, future)
            self._offload()  # what the calls published (a KV store), before a step can evict it
            try:
                self.step()
            except Exception as exc:  # a failed step must not stop the loop; its tasks fail instead
                logger.exception("engine step failed")
                self._failed_steps += 1
                for task in list(self.running):
                    self._finish(task, StreamDelta("", (), "error", error=f"engine step failed: {exc}"))
            self._offload()
            self._notify_step_listeners()
        for task in [*self.running, *self.waiting, *self._inbox, *self._loading()]:
            self._finish(task, StreamDelta("", (), "cancelled"))
        self._notify_step_listeners()
        with self._wake:
            for _, future in self._calls:
                future.set_exception(RuntimeError("the engine has shut down"))
            self._calls.clear()

    def _loading(self) -> list[Task]:
        return list(self.tiers.loading.values()) if self.tiers is not None else []

    def _take_loaded(self, batches: list[LoadedPages]) -> None:
        """Tasks whose tier pages came back go to the front of the queue."""
        for loaded in batches:
            task = self.tiers.arrived(loaded) if self.tiers is not None else None
            if task is not None:
                self.waiting.appendleft(task)

    def _offload(self) -> None:
        if self.tiers is not None:
            try:
                self.tiers.offload()
            except Exception:  # the pages stay in the pool; only their copies below are lost
                logger.exception("copying pages to the KV tiers failed")

    def _notify_step_listeners(self) -> None:
        for listener in self._step_listeners:
            try:
                listener()
            except Exception:
                logger.exception("a step listener failed")

    def step(self) -> None:
        """One scheduling step: room for decodes, admissions, one forward, sampling, publishing.

        If the step fails, its requests run again one by one, so that only the ones that fail
        alone end with an error and the others go on.
        """
        self._make_room_for_decodes()
        self._admit()
        entries, tasks = self._build_batch()
        if not entries:
            return
        self.stats.prefill_tokens += sum(e.num_new for e, t in zip(entries, tasks) if t.is_prefilling)
        lengths = [task.num_tokens for task in tasks]
        started = time.perf_counter()
        try:
            self._run(entries, tasks)
        except Exception:
            logger.exception("engine step failed; running its %d requests one by one", len(tasks))
            if self._run_each(entries, tasks, lengths):
                return
            self._failed_steps += 1
            if not self.healthy:
                logger.error("%d steps in a row failed every request: this engine reports itself unhealthy", self._failed_steps)
            return
        self._failed_steps = 0
        if self.speculator is not None and all(entry.is_decode for entry in entries):
            self.speculator.step_times.record(sum(entry.num_new for entry in entries), time.perf_counter() - started)

    def _run(self, entries: list[BatchEntry], tasks: list[Task]) -> None:
        """One forward over `entries`, then sampling for the tasks at the end of their tokens (a task with
        proposals samples a row for each, and one more)."""
        sample_rows, sampled, first_rows, row = [], [], [], 0
        for entry, task in zip(entries, tasks):
            row += entry.num_new
            if entry.end >= task.num_tokens:
                first_rows.append(len(sample_rows))
                sample_rows.extend(range(row - 1 - len(task.drafts), row))
                sampled.append(task)
        token_ids = [tok for entry, task in zip(entries, tasks) for tok in task.tokens[entry.start : entry.end] + task.drafts]
        slots = [task.adapter_slot for task in tasks]
        logits = self.runner.forward(ForwardBatch(entries, token_ids, sample_rows, slots), self.cache.view(entries))
        self.stats.steps += 1
        for entry, task in zip(entries, tasks):
            task.num_computed = min(entry.end, task.num_tokens)
            self.cache.commit(task.task_id, task.tokens, task.num_computed)
        if sampled:
            self._sample_and_publish(logits, sampled, first_rows)

    def _run_each(self, entries: list[BatchEntry], tasks: list[Task], lengths: list[int]) -> bool:
        """Run each entry alone; a task that fails alone ends with an error. True if any ran."""
        ran = False
        for entry, task, length in zip(entries, tasks, lengths):
            if task.state is TaskState.FINISHED or task.num_tokens != length:
                continue  # it finished, or it took its token before the failure
            try:
                self._run([entry], [task])
                ran = True
            except Exception as exc:
                logger.exception("task %d failed", task.task_id)
                self._finish(task, StreamDelta("", (), "error", error=f"engine step failed: {exc}"))
        if ran:
            self._failed_steps = 0
        return ran

    def _sample_and_publish(self, logits: torch.Tensor, tasks: list[Task], first_rows: list[int]) -> None:
        for task, emitted in zip(tasks, self.emitter.emit(logits, tasks, first_rows)):
            self.stats.total_tokens += len(emitted.delta.token_ids)
            if task.drafts:
                assert self.speculator is not None and task.speculation is not None
                self.speculator.record(task.speculation, len(task.drafts), emitted.accepted, len(emitted.delta.token_ids))
                task.drafts = []
                # The accepted proposals' k/v are the forward's; the rest is written over next step.
                task.num_computed += emitted.accepted
                self.cache.commit(task.task_id, task.tokens, task.num_computed)
            if emitted.delta.finish_reason is not None:
                self._finish(task, emitted.delta)
            else:
                task.result.publish(emitted.delta)

    # -- memory -----------------------------------------------------------------------------
    def _make_room_for_decodes(self) -> None:
        for task in sorted(self.running, key=lambda t: t.task_id):
            if task.state is not TaskState.RUNNING or task.is_prefilling:
                continue
            while not self.cache.grow(task.task_id, task.num_tokens):
                victim = max(self.running, key=lambda t: t.task_id)
                if victim is task and len(self.running) == 1:
                    # Alone and still out of memory: the cache cannot hold this task any longer.
                    self._finish(task, task.closing_delta("length"))
                    break
                self._preempt(victim)
                if victim is task:
                    break

    def _preempt(self, task: Task) -> None:
        """Recompute later: free the task's memory and put it at the front of the queue."""
        self.cache.release(task.task_id)
        self.running.remove(task)
        task.state = TaskState.WAITING
        task.num_computed = 0
        task.tiers_asked = False
        self.waiting.appendleft(task)
        self.stats.preemptions += 1
        logger.debug("preempted task %d at %d tokens", task.task_id, task.num_tokens)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            task = self.waiting[0]
            if task.num_tokens > self.cache.max_task_tokens:
                self.waiting.popleft()
                self._finish(task, task.closing_delta("length"))
                continue
            if self.tiers is not None and self.tiers.send(task):
                self.waiting.popleft()  # it waits aside for its pages; the next may go first
                continue
            if self.tiers is not None:
                cached = self.tiers.admit(task)
            else:
                cached = self.cache.admit(task.task_id, task.tokens, task.cache_salt)
            if cached is None:
                break
            self.waiting.popleft()
            task.num_computed = cached
            task.state = TaskState.RUNNING
            self.running.append(task)
            self.stats.prefix_cache_queried_tokens += task.num_tokens
            self.stats.prefix_cache_hit_tokens += cached
            if not task.admitted_once:
                task.admitted_once = True
                self.stats.prompt_tokens += task.prompt_len
                task.result.set_cached_tokens(cached)
                task.result.set_queue_time(time.monotonic() - task.submitted_at)

    def _build_batch(self) -> tuple[list[BatchEntry], list[Task]]:
        """Every decode token (and its proposals, where speculating), then prefill chunks while the token
        budget lasts; decode rows first."""
        budget = self.config.max_num_batched_tokens
        for task in self.running:
            task.drafts = []
        decodes = [task for task in self.running if not task.is_prefilling]
        if self.speculator is not None and decodes and self.speculator.proposes_at(len(decodes)):
            self._propose(decodes, budget - len(decodes))
        scheduled: list[tuple[BatchEntry, Task]] = []
        for task in sorted(self.running, key=lambda t: t.is_prefilling):
            chunk = min(task.num_tokens - task.num_computed, budget)
            if chunk <= 0:
                break
            budget -= chunk + len(task.drafts)
            scheduled.append((BatchEntry(task.task_id, task.num_computed, chunk + len(task.drafts), bool(task.drafts)), task))
        # Decode rows first, longest context first, so the attention can group similar lengths.
        scheduled.sort(key=lambda pair: (not pair[0].is_decode, -pair[0].end))
        return [entry for entry, _ in scheduled], [task for _, task in scheduled]

    def _propose(self, decodes: list[Task], spare: int) -> None:
        """Set the decodes' `drafts`: the proposals found for each that the step keeps, `spare` tokens at most,
        within each task's `max_tokens` and context, where the cache can hold them. A seeded sampled task
        gets none: which proposals a step keeps depends on measured step times, and each one verified
        draws from the task's generator, so its seed would not give the same tokens twice."""
        assert self.speculator is not None
        proposing = [task for task in decodes if task.generator is None]
        found = []
        for task in proposing:
            room = min(
                task.max_tokens - task.num_output - 1,  # the row's own token comes on top of them
                self.max_model_len - task.num_tokens,
                self.cache.max_task_tokens - task.num_tokens,
            )
            task.speculation, tokens = self.speculator.find(task.speculation, task.tokens, room)
            found.append(tokens)
        kept = self.speculator.keep(len(decodes), [(t.speculation, len(f)) for t, f in zip(proposing, found)], spare)
        for task, tokens, count in zip(proposing, found, kept):
            if count and self.cache.grow(task.task_id, task.num_tokens + count):
                task.drafts = tokens[:count]

    # -- endings ----------------------------------------------------------------------------
    def _cancel(self, task_ids: set[int]) -> None:
        if not task_ids:
            return
        for task in [t for t in [*self.running, *self.waiting, *self._loading()] if t.task_id in task_ids]:
            self._finish(task, StreamDelta("", (), "cancelled"))

    def _finish(self, task: Task, delta: StreamDelta) -> None:
        """Free the task's memory, then publish its final delta."""
        if task.state is TaskState.RUNNING:
            self.cache.release(task.task_id)
            self.running.remove(task)
        elif task in self.waiting:
            self.waiting.remove(task)
        elif self.tiers is not None:
            self.tiers.forget(task)
        task.state = TaskState.FINISHED
        if task.on_finished is not None:
            task.on_finished()
        task.result.publish(delta)


def _run_into(fn: Callable[[], object], future: Future) -> None:
    """Run `fn`, handing its result or exception to `future`."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as error:  # the caller re-raises it
        future.set_exception(error)
