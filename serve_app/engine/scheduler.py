"""Scheduler: the continuous-batching policy, with no thread and no model.

Each round it makes room for every running decode (preempting the task the scheduling policy ranks last,
by recompute, when pages run out), admits waiting tasks in the policy's order while memory lasts, and packs all
decode tokens (with their proposed tokens, under speculative decoding) and prefill chunks into one batch. A
batch's (background) tasks come after online ones in each of those, sit out every step in which an online task
waits or prefills, and add to the others only as many tokens as take about `background_step_s` (by the recent
steps' times), so that an online request that arrives finds no long step in its way. After the forward
it records what the cache now holds, and after sampling it publishes each task's output or ends it.
The loop (`loop.py`) calls it from the engine's thread; the step (`step.py`) runs the model.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from serve_app.config import SchedulerConfig
from serve_app.engine.emitting import Emitted
from serve_app.engine.speculation import Speculator
from serve_app.engine.step_cost import StepCost
from serve_app.engine.task import CachePin, Task, TaskState
from serve_app.engine.tier_loading import TierLoading
from serve_app.engine.waiting import WaitingQueue
from serve_app.kv.base import KVCache
from serve_app.kv.tiers.pages import LoadedPages
from serve_app.kv.view import BatchEntry
from serve_app.wire.calls import ITERATION_TOKEN_BUCKETS
from serve_app.wire.outputs import CoreOutput

logger = logging.getLogger(__name__)

# A batch's tasks prefill at most this fraction (1/N) of a step's token budget (and within `background_step_s`).
BACKGROUND_PREFILL_SHARE = 4


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
    step_tokens_sum: int = 0  # tokens over all steps' forwards
    step_tokens: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1))  # steps by size

    def record_step(self, tokens: int) -> None:
        """One forward of `tokens` tokens, counted in the first bucket whose bound holds it (the last: larger)."""
        self.steps += 1
        self.step_tokens_sum += tokens
        self.step_tokens[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, tokens)] += 1


@dataclass(frozen=True)
class Batch:
    """One forward's work: an entry per task (its new tokens' span), in the order the rows run."""

    entries: list[BatchEntry]
    tasks: list[Task]

    @property
    def is_decode_only(self) -> bool:
        return all(entry.is_decode for entry in self.entries)

    def alone(self) -> list[Batch]:
        """Each entry as a batch of its own."""
        return [Batch([entry], [task]) for entry, task in zip(self.entries, self.tasks)]


class Scheduler:
    """The waiting queue and the running set. Only the engine's loop thread calls it."""

    def __init__(
        self, cache: KVCache, config: SchedulerConfig, max_model_len: int, speculator: Speculator | None = None
    ) -> None:
        self.cache = cache
        self.config = config
        self.max_model_len = max_model_len
        self.speculator = speculator
        self.stats = SchedulerStats()
        self.step_cost = StepCost()
        self._background_next = 0  # the id from which a batch's tasks take their turns in the next step
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Task] = []
        self.tiers: TierLoading | None = None  # the KV tiers behind a paged cache, when configured

    @property
    def num_loading(self) -> int:
        """Tasks waiting aside for their pages from the KV tiers."""
        return len(self.tiers.loading) if self.tiers is not None else 0

    def add(self, tasks: Iterable[Task]) -> None:
        for task in tasks:
            self.waiting.add(task)

    def take_loaded(self, batches: Sequence[LoadedPages]) -> None:
        """Tasks whose tier pages came back go back to the queue (first, under fcfs)."""
        for loaded in batches:
            task = self.tiers.arrived(loaded) if self.tiers is not None else None
            if task is not None:
                self.waiting.put_back(task)

    def offload(self) -> None:
        """Copy the pages the pool published down to the KV tiers."""
        if self.tiers is not None:
            try:
                self.tiers.offload()
            except Exception:  # the pages stay in the pool; only their copies below are lost
                logger.exception("copying pages to the KV tiers failed")

    # -- one round ------------------------------------------------------------------------------
    def schedule(self) -> Batch | None:
        """Room for decodes, admissions, then the batch to run (None when there is nothing to run)."""
        self._make_room_for_decodes()
        self._admit()
        batch = self._build_batch()
        if not batch.entries:
            return None
        self.stats.prefill_tokens += sum(e.num_new for e, t in zip(batch.entries, batch.tasks) if t.is_prefilling)
        return batch

    def computed(self, batch: Batch) -> None:
        """The forward over `batch` wrote its tokens' k/v: publish what can be shared."""
        self.stats.record_step(sum(entry.num_new for entry in batch.entries))
        for entry, task in zip(batch.entries, batch.tasks):
            task.num_computed = min(entry.end, task.num_tokens)
            self.cache.commit(task.task_id, task.tokens, task.num_computed)
            if task.admission.pin is not None and task.num_computed >= task.admission.pin.tokens:
                self._pin(task, task.admission.pin)

    def _pin(self, task: Task, pin: CachePin) -> None:
        """Keep the prompt's prefix cached for its breakpoint's TTL; what the cache did not hold before was written."""
        kept = self.cache.pin(task.tokens[: pin.tokens], task.admission.prefix_salt, pin.ttl_s)
        task.admission.cache_written_tokens = max(0, kept - task.admission.cached_tokens)
        task.admission.pin = None

    def ran(self, batch: Batch, seconds: float) -> None:
        """A whole batch ran in `seconds`: what a step costs by its tokens; a decode-only one's time tells
        speculation what proposals cost."""
        tokens = sum(entry.num_new for entry in batch.entries)
        self.step_cost.record(tokens, seconds)
        if self.speculator is not None and batch.is_decode_only:
            self.speculator.step_times.record(tokens, seconds)

    def postprocess(self, tasks: Sequence[Task], emitted: Sequence[Emitted]) -> None:
        """Each sampled task's outcome: its accepted proposals kept, then its output published or its end."""
        for task, outcome in zip(tasks, emitted):
            self.stats.total_tokens += len(outcome.output.token_ids)
            if task.drafts:
                assert self.speculator is not None and task.speculation is not None
                self.speculator.record(task.speculation, len(task.drafts), outcome.accepted, len(outcome.output.token_ids))
                task.drafts = []
                # The accepted proposals' k/v are the forward's; the rest is written over next step.
                task.num_computed += outcome.accepted
                self.cache.commit(task.task_id, task.tokens, task.num_computed)
            if outcome.output.finish_reason is not None:
                self.finish(task, outcome.output)
            else:
                task.publish(outcome.output)

    # -- memory ---------------------------------------------------------------------------------
    def _make_room_for_decodes(self) -> None:
        rank = self.waiting.rank
        for task in sorted(self.running, key=rank):
            if task.state is not TaskState.RUNNING or task.is_prefilling:
                continue
            while not self.cache.grow(task.task_id, task.num_tokens):
                victim = max(self.running, key=rank)
                if victim is task and len(self.running) == 1:
                    # Alone and still out of memory: the cache cannot hold this task any longer.
                    self.finish(task, CoreOutput((), (), "length"))
                    break
                self._preempt(victim)
                if victim is task:
                    break

    def _preempt(self, task: Task) -> None:
        """Recompute later: free the task's memory and put it back in the queue (first, under fcfs)."""
        self.cache.release(task.task_id)
        self.running.remove(task)
        task.state = TaskState.WAITING
        task.num_computed = 0
        task.admission.tiers_asked = False
        self.waiting.put_back(task)
        self.stats.preemptions += 1
        logger.debug("preempted task %d at %d tokens", task.task_id, task.num_tokens)

    def _preempt_background(self) -> bool:
        """Preempt the running background task ranked last, if there is one."""
        background = [task for task in self.running if task.admission.background]
        if not background:
            return False
        self._preempt(max(background, key=self.waiting.rank))
        return True

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            task = self.waiting.first()
            if task.num_tokens > self.cache.max_task_tokens:
                self.waiting.pop_first()
                self.finish(task, CoreOutput((), (), "length"))
                continue
            if self.tiers is not None and self.tiers.send(task):
                self.waiting.pop_first()  # it waits aside for its pages; the next may go first
                continue
            if self.tiers is not None:
                cached = self.tiers.admit(task)
            else:
                cached = self.cache.admit(task.task_id, task.tokens, task.admission.prefix_salt)
            if cached is None:
                if not task.admission.background and self._preempt_background():
                    continue  # an online task takes a batch's memory
                break
            self.waiting.pop_first()
            task.num_computed = cached
            task.state = TaskState.RUNNING
            self.running.append(task)
            self.stats.prefix_cache_queried_tokens += task.num_tokens
            self.stats.prefix_cache_hit_tokens += cached
            if not task.admission.admitted_once:
                task.admission.admitted_once = True
                self.stats.prompt_tokens += task.prompt_len
                task.admitted(cached)

    def _build_batch(self) -> Batch:
        """Every decode token (and its proposals, where speculating), then prefill chunks while the token
        budget lasts; decode rows first."""
        budget = self.config.max_num_batched_tokens
        for task in self.running:
            task.drafts = []
        decodes = [task for task in self.running if not task.is_prefilling]
        if self.speculator is not None and decodes and self.speculator.proposes_at(len(decodes)):
            self._propose(decodes, budget - len(decodes))
        scheduled: list[tuple[BatchEntry, Task]] = []
        # While an online task waits or prefills, its first token comes first: the step is the online tasks' alone.
        online_first = self.waiting.has_online or any(t.is_prefilling and not t.admission.background for t in self.running)
        runnable = [task for task in self.running if not (online_first and task.admission.background)]
        background_budget = self._background_budget()
        background_prefill_budget = max(1, self.config.max_num_batched_tokens // BACKGROUND_PREFILL_SHARE)
        for task in self._in_turn(runnable):
            background = task.admission.background
            wanted = task.num_tokens - task.num_computed + len(task.drafts)  # a decode's token and its proposals
            if background and task.is_prefilling:
                wanted = min(wanted, background_prefill_budget)
            chunk = min(wanted, budget, background_budget) if background else min(wanted, budget)
            if chunk <= 0:
                if background:
                    continue  # a batch's task sits this step out
                break
            if task.drafts and chunk < wanted:
                continue  # its proposals ride whole or not at all: it sits this step out
            if background:
                background_budget -= chunk
                if task.is_prefilling:
                    background_prefill_budget -= chunk
                self._background_next = task.task_id + 1
            budget -= chunk
            scheduled.append((BatchEntry(task.task_id, task.num_computed, chunk, bool(task.drafts)), task))
        # Decode rows first, longest context first, so the attention can group similar lengths.
        scheduled.sort(key=lambda pair: (not pair[0].is_decode, -pair[0].end))
        return Batch([entry for entry, _ in scheduled], [task for _, task in scheduled])

    def _in_turn(self, runnable: list[Task]) -> list[Task]:
        """Online decodes, then online prefills, then a batch's tasks in turn by id, from the one after the last
        that ran: where a step holds only some of them, every batch's tasks move alike."""
        online = sorted((task for task in runnable if not task.admission.background), key=lambda t: t.is_prefilling)
        background = sorted((task for task in runnable if task.admission.background), key=lambda t: t.task_id)
        first = next((i for i, task in enumerate(background) if task.task_id >= self._background_next), 0)
        return [*online, *background[first:], *background[:first]]

    def _background_budget(self) -> int:
        """A batch's tokens this step may hold: as many as add about `background_step_s` to it (one at least),
        unbounded until the steps' cost is known."""
        adding = self.step_cost.tokens_adding(self.config.background_step_s)
        return self.config.max_num_batched_tokens if adding is None else max(1, adding)

    def _propose(self, decodes: list[Task], spare: int) -> None:
        """Set the decodes' `drafts`: the proposals found for each that the step keeps, `spare` tokens at most,
        within each task's `max_tokens` and context, where the cache can hold them. A seeded sampled task
        gets none: which proposals a step keeps depends on measured step times, and each one verified
        draws from the task's generator, so its seed would not give the same tokens twice."""
        assert self.speculator is not None
        proposing = [task for task in decodes if task.sampling.generator is None]
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

    # -- endings --------------------------------------------------------------------------------
    def cancel(self, task_ids: set[int]) -> None:
        if not task_ids:
            return
        for task in [t for t in [*self.running, *self.waiting, *self._loading()] if t.task_id in task_ids]:
            self.finish(task, CoreOutput((), (), "cancelled"))

    def fail_running(self, error: str) -> None:
        """End every running task with `error` (a round that failed outside any one task's step)."""
        for task in list(self.running):
            self.finish(task, CoreOutput((), (), "error", error=error))

    def cancel_all(self, also: Iterable[Task] = ()) -> None:
        """End every task it holds, and `also` (tasks not handed to it yet), as cancelled."""
        for task in [*self.running, *self.waiting, *also, *self._loading()]:
            self.finish(task, CoreOutput((), (), "cancelled"))

    def finish(self, task: Task, output: CoreOutput) -> None:
        """Free the task's memory, then publish its last output."""
        if task.state is TaskState.RUNNING:
            self.cache.release(task.task_id)
            self.running.remove(task)
        elif task in self.waiting:
            self.waiting.remove(task)
        elif self.tiers is not None:
            self.tiers.forget(task)
        task.state = TaskState.FINISHED
        task.release()
        task.publish(output)

    def _loading(self) -> list[Task]:
        return list(self.tiers.loading.values()) if self.tiers is not None else []
