"""TaskTable: each task's page table, how many of its pages are published, and its cached token count."""

from __future__ import annotations

from dataclasses import dataclass, field

from serve_app.kv.prefix_cache import PageHash


@dataclass
class TaskPages:
    """One task's pages in position order, and its progress through the prefix cache."""

    prefix_salt: str
    pages: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    num_published: int = 0
    last_hash: PageHash | None = None


class TaskTable:
    """task id -> `TaskPages`."""

    def __init__(self) -> None:
        self._tasks: dict[int, TaskPages] = {}

    def add(self, task_id: int, entry: TaskPages) -> None:
        if task_id in self._tasks:
            raise KeyError(f"task {task_id} already holds pages")
        self._tasks[task_id] = entry

    def __getitem__(self, task_id: int) -> TaskPages:
        return self._tasks[task_id]

    def pop(self, task_id: int) -> TaskPages | None:
        return self._tasks.pop(task_id, None)

    def __len__(self) -> int:
        return len(self._tasks)
