"""The scheduling policy alone, with no model and no thread: admission, chunked prefill, the batch's order,
preemption by recompute, and endings that give every page back. Each "step" here accepts a token the way
the model step's emitter does, so the scheduler sees what it sees in an engine."""

from __future__ import annotations

import torch

from serve_app.config import SchedulerConfig
from serve_app.engine.emitting import Emitted
from serve_app.engine.scheduler import Batch, Scheduler
from serve_app.engine.task import Task, TaskAdmission, TaskSampling, TaskState
from serve_app.engine.task_output import TaskOutput
from serve_app.kv.page_cache import PageCache
from serve_app.kv.storage import KVShape
from serve_app.wire.outputs import CoreOutput, merge_outputs
from serve_app.wire.requests import SamplingParams

PAGE = 4
MAX_MODEL_LEN = 256


def _scheduler(pages: int, **limits: int) -> Scheduler:
    cache = PageCache(KVShape(1, 1, 4, torch.float32), pages * PAGE, PAGE, torch.device("cpu"), enable_prefix_caching=True)
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 16, **limits})
    return Scheduler(cache, config, MAX_MODEL_LEN)


_OUTPUTS: dict[int, list[CoreOutput]] = {}  # id(task) -> the outputs it published


def _task(task_id: int, prompt: list[int], max_tokens: int = 8, priority: int = 0, background: bool = False) -> Task:
    outputs: list[CoreOutput] = []
    output = TaskOutput(lambda _, published: outputs.append(published))
    task = Task(
        task_id, len(prompt), list(prompt), max_tokens, TaskSampling(SamplingParams(temperature=0), frozenset()), output,
        TaskAdmission("", priority, background=background),
    )
    _OUTPUTS[id(task)] = outputs
    return task


def _result(task: Task) -> CoreOutput:
    """What its outputs add up to so far."""
    return merge_outputs(_OUTPUTS[id(task)] or [CoreOutput((), ())])


def _step(scheduler: Scheduler, token: int = 42) -> Batch | None:
    """What the engine's step does around the forward: schedule, record the k/v written, accept a token for
    each task at the end of its tokens, postprocess."""
    batch = scheduler.schedule()
    if batch is None:
        return None
    sampled = [task for entry, task in zip(batch.entries, batch.tasks) if entry.end >= task.num_tokens]
    scheduler.computed(batch)
    scheduler.postprocess(sampled, [Emitted(task.accept(token, MAX_MODEL_LEN), 0) for task in sampled])
    return batch


def _spans(batch: Batch) -> list[tuple[int, int, int]]:
    return [(entry.task_id, entry.start, entry.num_new) for entry in batch.entries]


def test_prefills_are_chunked_to_the_token_budget_and_decodes_come_first() -> None:
    scheduler = _scheduler(pages=32)
    first, second = _task(1, list(range(100, 110))), _task(2, list(range(200, 220)))
    scheduler.add([first, second])
    assert _spans(_step(scheduler)) == [(1, 0, 10), (2, 0, 6)]  # 16 tokens: all of one prompt, a chunk of the other
    assert first.num_output == 1 and second.num_output == 0 and second.is_prefilling
    assert _spans(_step(scheduler)) == [(1, 10, 1), (2, 6, 14)]  # the decode row first, then the rest of the prefill
    assert first.num_output == 2 and second.num_output == 1
    assert _spans(_step(scheduler)) == [(2, 20, 1), (1, 11, 1)]  # decodes only, longest context first
    assert scheduler.stats.prefill_tokens == 30 and scheduler.stats.steps == 3


def test_admission_stops_at_max_num_seqs_and_a_finished_task_lets_the_next_in() -> None:
    scheduler = _scheduler(pages=32, max_num_seqs=2)
    tasks = [_task(i, [i] * 4, max_tokens=2) for i in (1, 2, 3)]
    scheduler.add(tasks)
    _step(scheduler)
    assert [t.task_id for t in scheduler.running] == [1, 2] and [t.task_id for t in scheduler.waiting] == [3]
    _step(scheduler)  # the second token ends the first two (max_tokens=2)
    assert [_result(t).finish_reason for t in tasks[:2]] == ["length", "length"]
    _step(scheduler)
    assert [t.task_id for t in scheduler.running] == [3]
    assert scheduler.stats.prompt_tokens == 12


def test_a_decode_out_of_pages_preempts_the_newest_task_which_recomputes_later() -> None:
    scheduler = _scheduler(pages=8)  # one page kept free for admissions
    older, newer = _task(1, [7] * 12, max_tokens=20), _task(2, [8] * 12, max_tokens=20)
    scheduler.add([older, newer])
    _step(scheduler)  # both prefilled: 3 full pages each, a token each
    assert scheduler.cache.usage().free == 2
    while scheduler.stats.preemptions == 0:
        _step(scheduler)
    assert older.state is TaskState.RUNNING and newer.state is TaskState.WAITING
    assert list(scheduler.waiting) == [newer] and newer.num_computed == 0
    assert older.num_output > newer.num_output  # the newer one stopped growing when it was preempted
    for _ in range(40):
        if _result(older).finish_reason and _result(newer).finish_reason:
            break
        _step(scheduler)
    assert _result(older).finish_reason == _result(newer).finish_reason == "length"
    assert _result(older).token_ids == _result(newer).token_ids == (42,) * 20  # the preempted one lost no token
    assert scheduler.cache.usage().free == 8


def test_the_priority_policy_admits_lower_priorities_first_and_preempts_the_highest() -> None:
    scheduler = _scheduler(pages=8, max_num_seqs=1, scheduling_policy="priority")
    late, urgent, also_urgent = (_task(i, [i] * 4, max_tokens=2, priority=p) for i, p in ((1, 5), (2, -1), (3, -1)))
    scheduler.add([late, urgent, also_urgent])
    assert list(scheduler.waiting) == [urgent, also_urgent, late]  # by priority, then arrival
    order = []
    while len(order) < 3:
        batch = _step(scheduler)
        order += [t.task_id for t in batch.tasks if t.task_id not in order]
    assert order == [2, 3, 1]
    while scheduler.running or len(scheduler.waiting):
        _step(scheduler)
    preempting = _scheduler(pages=8, scheduling_policy="priority")
    low, high = _task(1, [7] * 12, max_tokens=20, priority=9), _task(2, [8] * 12, max_tokens=20)
    preempting.add([low, high])
    while preempting.stats.preemptions == 0:
        _step(preempting)
    assert low.state is TaskState.WAITING and high.state is TaskState.RUNNING  # the older task, ranked last, gives way


def test_fcfs_puts_a_preempted_task_back_first() -> None:
    scheduler = _scheduler(pages=8)
    tasks = [_task(i, [i] * 4, priority=9 - i) for i in (1, 2, 3)]
    scheduler.add(tasks[1:])
    scheduler.waiting.put_back(tasks[0])
    assert list(scheduler.waiting) == tasks  # priorities mean nothing first come, first served


def test_a_prompt_longer_than_the_cache_can_hold_ends_with_length_at_admission() -> None:
    scheduler = _scheduler(pages=8)
    too_long = _task(1, [5] * (scheduler.cache.max_task_tokens + 1))
    scheduler.add([too_long])
    assert scheduler.schedule() is None
    assert _result(too_long).finish_reason == "length" and _result(too_long).token_ids == ()


def test_a_second_prompt_with_the_same_pages_is_admitted_with_them_cached() -> None:
    scheduler = _scheduler(pages=32)
    prompt = list(range(300, 313))  # three full pages and one token
    first = _task(1, prompt, max_tokens=1)
    scheduler.add([first])
    _step(scheduler)
    assert _result(first).finish_reason == "length" and _result(first).usage.cached_tokens == 0
    second = _task(2, prompt, max_tokens=1)
    scheduler.add([second])
    assert _spans(scheduler.schedule()) == [(2, 12, 1)]  # only the token after the cached pages runs
    assert second.admission.cached_tokens == 12
    assert scheduler.stats.prefix_cache_queried_tokens == 26 and scheduler.stats.prefix_cache_hit_tokens == 12


def test_cancelling_and_cancel_all_give_every_page_back() -> None:
    scheduler = _scheduler(pages=32, max_num_seqs=2)
    tasks = [_task(i, [i] * 9) for i in (1, 2, 3)]
    scheduler.add(tasks)
    _step(scheduler)
    scheduler.cancel({1})
    assert _result(tasks[0]).finish_reason == "cancelled" and [t.task_id for t in scheduler.running] == [2]
    late = _task(4, [4] * 5)
    scheduler.cancel_all(also=[late])
    assert [_result(t).finish_reason for t in [*tasks, late]] == ["cancelled"] * 4
    assert not scheduler.running and not scheduler.waiting
    assert scheduler.cache.usage().free == 32


def test_a_batchs_tasks_wait_behind_online_ones_and_sit_out_their_prefills() -> None:
    scheduler = _scheduler(pages=64, max_num_batched_tokens=16)  # a batch's prefill: 4 tokens a step at most
    batch = [_task(i, list(range(10 * i, 10 * i + 10)), background=True) for i in (1, 2)]
    scheduler.add(batch)
    assert _spans(_step(scheduler)) == [(1, 0, 4)]  # alone, still in small chunks
    online, later = _task(3, list(range(300, 312))), _task(4, [7] * 4, background=True)
    scheduler.add([later, online])
    assert [t.task_id for t in scheduler.waiting] == [3, 4]  # the online task waits first
    assert _spans(_step(scheduler)) == [(3, 0, 12)]  # it prefills alone: the batch sits the step out
    assert _spans(_step(scheduler)) == [(3, 12, 1), (2, 0, 4)]  # its decode, then the batch's next task's chunk
    assert _spans(_step(scheduler)) == [(3, 13, 1), (4, 0, 4)]  # the batch's tasks take turns
    for _ in range(2):
        _step(scheduler)
    decoding = [t for t in batch if not t.is_prefilling]
    assert decoding, "a batch task decodes by now"
    scheduler.add([_task(5, [9] * 8)])
    assert _spans(_step(scheduler)) == [(3, 16, 1), (5, 0, 8)]  # a new online prefill: the batch's decodes sit out too


def test_an_online_task_takes_memory_from_a_batchs_task() -> None:
    scheduler = _scheduler(pages=6)  # 24 tokens
    background = _task(1, list(range(100, 116)), max_tokens=4, background=True)
    scheduler.add([background])
    while background.is_prefilling or background.state is not TaskState.RUNNING:
        _step(scheduler)
    online = _task(2, list(range(200, 216)), max_tokens=4)
    scheduler.add([online])
    _step(scheduler)
    assert online.state is TaskState.RUNNING and background.state is TaskState.WAITING  # preempted by recompute
    assert scheduler.stats.preemptions == 1
    while _step(scheduler) is not None:
        pass
    assert _result(online).finish_reason == "length" and _result(background).finish_reason == "length"
    assert scheduler.cache.usage().free == 6


def test_a_batchs_tokens_add_at_most_the_background_step_time_to_a_step() -> None:
    scheduler = _scheduler(pages=64, max_num_seqs=12, max_num_batched_tokens=64, background_step_s=0.0085)
    batch = [_task(i, [i] * 3, max_tokens=40, background=True) for i in range(1, 11)]
    scheduler.add(batch)
    assert sum(entry.num_new for entry in _step(scheduler).entries) == 16  # steps' cost not known: a prefill share
    for tokens in (2, 10, 30) * 4:  # steps cost 2 ms plus 1 ms a token: 8 tokens add 8 ms
        scheduler.step_cost.record(tokens, 0.002 + 0.001 * tokens)
    for _ in range(3):
        assert sum(entry.num_new for entry in _step(scheduler).entries) == 8  # of 30 prompt tokens and 10 decodes
    for _ in range(10):
        if not any(task.is_prefilling for task in batch):
            break
        assert sum(entry.num_new for entry in _step(scheduler).entries) == 8
    turns = [task.num_output for task in batch]
    for _ in range(5):  # ten decodes, eight a step: they take turns
        assert len(_step(scheduler).entries) == 8
    assert [task.num_output - before for task, before in zip(batch, turns)] == [4] * 10
    online = _task(20, [5] * 3, max_tokens=40)
    scheduler.add([online])
    assert _spans(_step(scheduler)) == [(20, 0, 3)]  # its prefill alone
    for _ in range(3):  # its decode row beside eight of the batch's tokens
        entries = _step(scheduler).entries
        assert sum(entry.num_new for entry in entries) == 9 and sum(entry.task_id == 20 for entry in entries) == 1
    scheduler.config = scheduler.config.model_copy(update={"background_step_s": 0.0001})  # less than a token's cost
    assert len(_step(scheduler).entries) == 2  # one of the batch's tokens a step, never none
