"""BatchRunner: runs the Batch API's batches from the store. A batch is validated as OpenAI's is (every line a
request for its endpoint, custom_ids unique, within `max_batch_lines`; else it fails, its errors listed), then
its lines are answered. Every running batch shares `concurrency` slots (what batches take of the engines beside
online traffic) in turn, a line each, so one tenant's long batch does not hold back another's. Each result is
appended to the output file (a 200) or the error file (anything else) as it comes. A line that meets a server
fault (an engine replica lost: a 5xx) is tried again before it is written as an error. A batch resumed after a
restart does only the lines its files do not answer. Cancelling stops its requests; what was answered stays in
its files."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from serve_app.batch.answering import AnsweredLine, BatchAnswerer
from serve_app.batch.file_format import LineError, line_key, read_line, result_key
from serve_app.batch.store import BatchStore

logger = logging.getLogger(__name__)

# A line answered with a server fault (an engine replica lost and being replaced) is tried this many times in all,
# this long apart at first, doubling (some 30 s in all).
ATTEMPTS = 6
RETRY_AFTER_S = 1.0
# How often running batches' records (their counts) are saved; how often the store is looked at for new batches
# besides when one is created.
CHECK_EVERY_S = 0.5
SCAN_EVERY_S = 5.0
# The most validation errors a failed batch lists.
MAX_LISTED_ERRORS = 16


@dataclass
class _Running:
    """A batch being answered: its record, the lines still to send, the requests in flight."""

    tenant: str
    batch: dict[str, Any]
    pending: Iterator[str]
    answerer: BatchAnswerer
    in_flight: set[asyncio.Task[AnsweredLine]] = field(default_factory=set)
    sent_all: bool = False
    saved_at: float = 0.0

    def next_line(self) -> str | None:
        text = next(self.pending, None)
        self.sent_all = text is None
        return text


class BatchRunner:
    def __init__(self, store: BatchStore, answerer_for: Callable[[str], BatchAnswerer], concurrency: int) -> None:
        self.store = store
        self.answerer_for = answerer_for  # a tenant's answerer (its cache salt)
        self.concurrency = concurrency
        self._wake = asyncio.Event()
        self._running: dict[str, _Running] = {}  # by batch id

    def wake(self) -> None:
        """A batch was created: look at the store now."""
        self._wake.set()

    def cancel(self, tenant: str, batch_id: str) -> dict[str, Any]:
        """Cancel a batch (StoreError where it has ended otherwise): a running one stops its requests at once."""
        self.store.batch(tenant, batch_id)  # the tenant's own, or not found
        running = self._running.get(batch_id)
        if running is None:
            return self.store.cancel_batch(tenant, batch_id)
        batch = running.batch
        if batch["status"] == "in_progress":
            batch["status"], batch["cancelling_at"] = "cancelling", int(time.time())
            self.store.save_batch(tenant, batch)
        self.wake()
        return dict(batch)

    async def run(self) -> None:
        """Run batches as they come, forever."""
        next_scan = 0.0
        try:
            while True:
                if self._wake.is_set() or time.monotonic() >= next_scan:
                    self._wake.clear()
                    self._take_new()
                    next_scan = time.monotonic() + SCAN_EVERY_S
                self._fill_slots()
                tasks = {task for running in self._running.values() for task in running.in_flight}
                woken = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait({*tasks, woken}, timeout=CHECK_EVERY_S if tasks else SCAN_EVERY_S,
                                   return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
                for running in list(self._running.values()):
                    try:
                        self._settle(running)
                    except Exception:  # the store failed it: the batch fails, the runner goes on
                        logger.exception("batch %s failed", running.batch["id"])
                        self._running.pop(running.batch["id"], None)
                        self._end(running.tenant, running.batch, "failed")
        finally:
            for running in self._running.values():
                for task in running.in_flight:
                    task.cancel()

    def _take_new(self) -> None:
        """Start the store's unfinished batches that are not running yet (validated first)."""
        for tenant, batch in self.store.unfinished():
            if batch["id"] in self._running:
                continue
            try:
                running = self._start(tenant, batch)
            except Exception:  # a fault of the store's or the server's: the batch fails, the runner goes on
                logger.exception("batch %s failed", batch["id"])
                self._end(tenant, self.store.batch(tenant, batch["id"]), "failed")
                continue
            if running is not None:
                self._running[batch["id"]] = running

    def _start(self, tenant: str, batch: dict[str, Any]) -> _Running | None:
        """A batch made ready to answer: validated (and its files made) if new; None where it has ended here."""
        if batch["status"] == "cancelling":
            self._end(tenant, batch, "cancelled")
            return None
        lines = self.store.content(tenant, batch["input_file_id"]).decode("utf-8", errors="replace").splitlines()
        lines = [line for line in lines if line.strip()]
        if batch["status"] == "validating":
            errors = self._validate(lines, batch["endpoint"])
            if errors:
                batch["errors"] = {"object": "list", "data": errors}
                self._end(tenant, batch, "failed")
                return None
            name = batch["id"]
            batch["output_file_id"] = self.store.new_output_file(tenant, f"{name}_output.jsonl")["id"]
            batch["error_file_id"] = self.store.new_output_file(tenant, f"{name}_error.jsonl")["id"]
            batch["status"], batch["in_progress_at"] = "in_progress", int(time.time())
            batch["request_counts"]["total"] = len(lines)
            batch["model"] = self._model(lines)
            self.store.save_batch(tenant, batch)
        answered = self._answered(tenant, batch)
        todo = iter([line for line in lines if line_key(line) not in answered])
        return _Running(tenant, batch, todo, self.answerer_for(tenant))

    def _fill_slots(self) -> None:
        """Send lines while slots are free: a line from each running batch in turn (the batch that sent last goes
        last, also from one call to the next, where slots free up one at a time)."""
        free = self.concurrency - sum(len(running.in_flight) for running in self._running.values())
        while free > 0:
            sending = [r for r in self._running.values() if not r.sent_all and r.batch["status"] == "in_progress"]
            if not sending:
                return
            for running in sending:
                text = running.next_line() if free > 0 else None
                if text is not None:
                    running.in_flight.add(asyncio.create_task(_answer_line(running.answerer, text)))
                    free -= 1
                    batch_id = running.batch["id"]
                    self._running[batch_id] = self._running.pop(batch_id)  # its next turn comes after the others'

    def _settle(self, running: _Running) -> None:
        """Record what a batch's finished requests answered; end it when it is done, cancelled or expired."""
        done = {task for task in running.in_flight if task.done()}
        running.in_flight -= done
        self._record(running.tenant, running.batch, [task.result() for task in done if not task.cancelled()])
        batch = running.batch
        ended = None
        if batch["status"] == "cancelling":
            ended = "cancelled"
        elif time.time() > batch["expires_at"]:
            ended = "expired"
        elif running.sent_all and not running.in_flight:
            ended = "completed"
        if ended is None:
            if time.monotonic() - running.saved_at >= CHECK_EVERY_S:
                running.saved_at = time.monotonic()
                self.store.save_batch(running.tenant, batch)
            return
        for task in running.in_flight:
            task.cancel()
        del self._running[batch["id"]]
        self._end(running.tenant, batch, ended)

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
