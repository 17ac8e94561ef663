"""WaitingQueue: the tasks waiting for admission, in the order the scheduling policy admits them (first come
first served, or by priority then arrival, as vLLM's `scheduling_policy`; online tasks before a batch's), and
which running task that order gives up first when memory runs out."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Literal

from serve_app.engine.task import Task

SchedulingPolicy = Literal["fcfs", "priority"]


class WaitingQueue:
    """Tasks in admission order, online tasks before background ones (a batch's). Under `fcfs` a task put back
    (preempted, or its tier pages arrived) goes first among its kind; under `priority` every task takes its
    place by (priority, arrival), lower first, among its kind."""

    def __init__(self, policy: SchedulingPolicy = "fcfs") -> None:
        self.policy = policy
        self._tasks: list[Task] = []

    def rank(self, task: Task) -> tuple[bool, int, int]:
        """Where a task stands: earlier ranks are admitted first and preempted last."""
        return (task.admission.background, task.admission.priority if self.policy == "priority" else 0, task.task_id)

    def add(self, task: Task) -> None:
        if self.policy == "priority":
            bisect.insort(self._tasks, task, key=self.rank)
        elif task.admission.background:
            self._tasks.append(task)
        else:
            self._tasks.insert(self._first_background(), task)

    def put_back(self, task: Task) -> None:
        if self.policy == "priority":
            bisect.insort(self._tasks, task, key=self.rank)
        else:
            self._tasks.insert(self._first_background() if task.admission.background else 0, task)

    def _first_background(self) -> int:
        return next((i for i, task in enumerate(self._tasks) if task.admission.background), len(self._tasks))

    @property
    def has_online(self) -> bool:
        """An online task waits."""
        return bool(self._tasks) and not self._tasks[0].admission.background

    def first(self) -> Task:
        return self._tasks[0]

    def pop_first(self) -> Task:
        return self._tasks.pop(0)

    def remove(self, task: Task) -> None:
        self._tasks.remove(task)

    def __contains__(self, task: object) -> bool:
        return task in self._tasks

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[Task]:
        return iter(list(self._tasks))
