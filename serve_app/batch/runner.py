"""BatchRunner: runs the Batch API's batches from the store, oldest first. A batch is validated as OpenAI's is (every
line a request for its endpoint, custom_ids unique, within `max_batch_lines`; else it fails, its errors listed),
then its lines are answered, at most `concurrency` at once (what a batch may take of the engines beside online
traffic), each result appended to the output file (a 200) or the error file (anything else) as it comes. A line
that meets a server fault (an engine replica lost: a 5xx) is tried again before it is written as an error. A
batch resumed after a restart does only the lines its files do not answer. Cancelling stops its requests;
what was answered stays in its files."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from serve_app.batch.answering import AnsweredLine, BatchAnswerer
from serve_app.batch.file_format import LineError, line_key, read_line, result_key
from serve_app.batch.store import BatchStore

logger = logging.getLogger(__name__)

# A line answered with a server fault (an engine replica lost and being replaced) is tried this many times in all,
# this long apart at first, doubling (some 30 s in all).
ATTEMPTS = 6
RETRY_AFTER_S = 1.0
# How often a running batch's record (its counts) is saved and its cancellation looked for.
CHECK_EVERY_S = 0.5
# The most validation errors a failed batch lists.
MAX_LISTED_ERRORS = 16


class BatchRunner:
    def __init__(self, store: BatchStore, answerer_for: Callable[[str], BatchAnswerer], concurrency: int) -> None:
        self.store = store
        self.answerer_for = answerer_for  # a tenant's answerer (its cache salt)
        self.concurrency = concurrency
        self._wake = asyncio.Event()
        self._running: dict[str, Any] | None = None  # the record of the batch running now

    def wake(self) -> None:
        """A batch was created: look at the store now."""
        self._wake.set()

    def cancel(self, tenant: str, batch_id: str) -> dict[str, Any]:
        """Cancel a batch (StoreError where it has ended otherwise): the running one stops its requests at once."""
        self.store.batch(tenant, batch_id)  # the tenant's own, or not found
        running = self._running
        if running is None or running["id"] != batch_id:
            return self.store.cancel_batch(tenant, batch_id)
        if running["status"] in ("validating", "in_progress"):
            running["status"], running["cancelling_at"] = "cancelling", int(time.time())
            self.store.save_batch(tenant, running)
        return dict(running)

    async def run(self) -> None:
        """Run unfinished batches as they come, forever."""
        while True:
            for tenant, batch in self.store.unfinished():
                try:
                    await self.run_batch(tenant, batch)
                except Exception:  # a fault of the store's or the server's: the batch fails, the runner goes on
                    logger.exception("batch %s failed", batch["id"])
                    self._end(tenant, self.store.batch(tenant, batch["id"]), "failed")
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=CHECK_EVERY_S * 4)
            except TimeoutError:
                pass

    async def run_batch(self, tenant: str, batch: dict[str, Any]) -> None:
        batch = self.store.batch(tenant, batch["id"])  # as it is now (cancelled since the runner listed it?)
        self._running = batch
        try:
            await self._run(tenant, batch)
        finally:
            self._running = None

    async def _run(self, tenant: str, batch: dict[str, Any]) -> None:
        if batch["status"] == "cancelling":
            self._end(tenant, batch, "cancelled")
            return
        lines = self.store.content(tenant, batch["input_file_id"]).decode("utf-8", errors="replace").splitlines()
        lines = [line for line in lines if line.strip()]
        if batch["status"] == "validating":
            errors = self._validate(lines, batch["endpoint"])
            if errors:
                batch["errors"] = {"object": "list", "data": errors}
                self._end(tenant, batch, "failed")
                return
            name = batch["id"]
            batch["output_file_id"] = self.store.new_output_file(tenant, f"{name}_output.jsonl")["id"]
            batch["error_file_id"] = self.store.new_output_file(tenant, f"{name}_error.jsonl")["id"]
            batch["status"], batch["in_progress_at"] = "in_progress", int(time.time())
            batch["request_counts"]["total"] = len(lines)
            batch["model"] = self._model(lines)
            self.store.save_batch(tenant, batch)
        answered = self._answered(tenant, batch)
        todo = [line for line in lines if line_key(line) not in answered]
        ended = await self._answer(tenant, batch, todo)
        self._end(tenant, batch, ended)

    def _validate(self, lines: list[str], endpoint: str) -> list[dict[str, Any]]:
        """OpenAI's checks of a batch's input file: its errors (none for a file that can run)."""
        errors: list[dict[str, Any]] = []
        if not lines:
            errors.append({"code": "empty_file", "message": "the input file has no requests", "param": None, "line": None})
        if len(lines) > self.store.max_lines:
            errors.append({"code": "too_many_requests", "message": f"{len(lines)} requests, over max_batch_lines="
                           f"{self.store.max_lines}", "param": None, "line": None})
        seen: set[str] = set()
        for number, text in enumerate(lines, start=1):
            try:
                line = read_line(text)
            except LineError as error:
                errors.append({"code": error.code, "message": error.message, "param": None, "line": number})
                continue
            if line.url != endpoint:
                errors.append({"code": "mismatched_url", "message": f"url {line.url!r} is not the batch's endpoint "
                               f"{endpoint!r}", "param": "url", "line": number})
            if line.custom_id in seen:
                errors.append({"code": "duplicate_custom_id", "message": f"custom_id {line.custom_id!r} is used twice",
                               "param": "custom_id", "line": number})
            seen.add(line.custom_id)
        return errors[:MAX_LISTED_ERRORS]

    @staticmethod
    def _model(lines: list[str]) -> str | None:
        """The model the batch's first request names."""
        model = read_line(lines[0]).body.get("model")
        return model if isinstance(model, str) else None

    def _answered(self, tenant: str, batch: dict[str, Any]) -> set[str]:
        """The lines the batch's output and error files answer already."""
        keys: set[str] = set()
        for file_id in (batch["output_file_id"], batch["error_file_id"]):
            for text in self.store.content(tenant, file_id).decode().splitlines():
                try:
                    key = result_key(json.loads(text))
                except ValueError:
                    continue
                if key is not None:
                    keys.add(key)
        return keys

    async def _answer(self, tenant: str, batch: dict[str, Any], todo: list[str]) -> str:
        """Answer `todo`, at most `concurrency` at once; the status the batch ends in."""
        answerer = self.answerer_for(tenant)
        pending = iter(todo)
        running: set[asyncio.Task[AnsweredLine]] = set()
        last_check = time.monotonic()
        try:
            while True:
                while len(running) < self.concurrency and (text := next(pending, None)) is not None:
                    running.add(asyncio.create_task(_answer_line(answerer, text)))
                if not running:
                    return "completed"
                done, running = await asyncio.wait(running, timeout=CHECK_EVERY_S, return_when=asyncio.FIRST_COMPLETED)
                self._record(tenant, batch, [task.result() for task in done])
                if batch["status"] == "cancelling":
                    return "cancelled"
                if time.monotonic() - last_check >= CHECK_EVERY_S:
                    last_check = time.monotonic()
                    self.store.save_batch(tenant, batch)
                    if time.time() > batch["expires_at"]:
                        return "expired"
        finally:
            for task in running:
                task.cancel()
            if running:
                await asyncio.wait(running)

    def _record(self, tenant: str, batch: dict[str, Any], answered: list[AnsweredLine]) -> None:
        good = [a.result for a in answered if not a.failed]
        bad = [a.result for a in answered if a.failed]
        if good:
            self.store.append(tenant, batch["output_file_id"], good)
        if bad:
            self.store.append(tenant, batch["error_file_id"], bad)
        counts, usage = batch["request_counts"], batch["usage"]
        counts["completed"] += len(good)
        counts["failed"] += len(bad)
        usage["input_tokens"] += sum(a.prompt_tokens for a in answered)
        usage["output_tokens"] += sum(a.completion_tokens for a in answered)
        usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]

    def _end(self, tenant: str, batch: dict[str, Any], status: str) -> None:
        now = int(time.time())
        if status == "completed":
            batch["finalizing_at"] = now
        batch["status"], batch[f"{status}_at"] = status, now
        self.store.save_batch(tenant, batch)
        logger.info("batch %s %s: %s", batch["id"], status, batch["request_counts"])


async def _answer_line(answerer: BatchAnswerer, text: str) -> AnsweredLine:
    """A line's answer, tried again (up to ATTEMPTS in all) while the server faults."""
    wait = RETRY_AFTER_S
    for _ in range(ATTEMPTS - 1):
        answered = await answerer.answer(text)
        if answered.status_code is None or answered.status_code < 500:
            return answered
        await asyncio.sleep(wait)
        wait *= 2
    return await answerer.answer(text)
