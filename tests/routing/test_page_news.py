"""The page news without Ray: a replica's reporter (page events at once, other stats on a heartbeat, a report
the board missed sent again), the board's record of live replicas, and routers waiting on the directory's news."""

from __future__ import annotations

import asyncio
import contextlib
import time

from serve_app.routing.page_news import PageNews
from serve_app.routing.page_reporter import PageReporter
from serve_app.routing.replica_reports import ReplicaReports
from serve_app.wire.page_events import PageEventBatch

A, B = b"a" * 16, b"b" * 16


def test_a_waiting_router_hears_of_a_replicas_pages_as_soon_as_they_are_published() -> None:
    async def scenario() -> tuple[int, tuple]:
        news = PageNews()
        news.publish("r1", PageEventBatch(snapshot=frozenset({A})), 16)
        waiting = asyncio.ensure_future(news.changes(since=1, wait_s=60))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # nothing new after seq 1 yet
        news.publish("r1", PageEventBatch(stored=frozenset({B})), 16)
        changes = await asyncio.wait_for(waiting, 10)  # well before its 60 s wait
        return changes.seq, changes.batches

    seq, batches = asyncio.run(scenario())
    assert seq == 2 and batches == (("r1", PageEventBatch(stored=frozenset({B}))),)


def test_a_replica_silent_past_the_stale_time_is_dropped_and_its_pages_forgotten() -> None:
    reports, news = ReplicaReports(stale_after_s=0.2), PageNews()
    assert not reports.record("r1", {"pid": 1}, {"active_tasks": 0})
    assert reports.record("r1", {"pid": 1}, {"active_tasks": 2})  # known now
    news.publish("r1", PageEventBatch(snapshot=frozenset({A})), 16)
    assert reports.live() == {"r1": {"pid": 1, "active_tasks": 2}}
    time.sleep(0.3)
    gone = reports.drop_stale()
    news.forget(gone)
    assert gone == ["r1"] and reports.live() == {} and news.directory.pages_of("r1") == frozenset()
    assert not reports.record("r1", {"pid": 1}, {"active_tasks": 0})  # back: unknown, so it sends a snapshot


def test_the_reporter_sends_page_events_at_once_other_stats_on_its_heartbeat_and_again_what_was_missed() -> None:
    events = [PageEventBatch(snapshot=frozenset({A}))]
    sent: list[tuple[dict[str, int], PageEventBatch]] = []
    outcomes = [False, RuntimeError("the board is restarting"), True]  # then False
    resent: list[bool] = []
    stats = {"active_tasks": 0, "waiting_queue": 0, "total_tokens": 0}

    async def send(report: dict[str, int], pages: PageEventBatch) -> bool:
        sent.append((dict(report), pages))
        outcome = outcomes.pop(0) if outcomes else False
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def scenario() -> None:
        reporter = PageReporter(
            lambda: dict(stats), lambda: events.pop(0) if events else PageEventBatch(), send, lambda: resent.append(True),
            every_s=0.01, heartbeat_s=0.5,
        )
        task = asyncio.ensure_future(reporter.run())
        await asyncio.sleep(0.1)
        assert len(sent) == 1 and sent[0][1] == PageEventBatch(snapshot=frozenset({A}))  # at once, then quiet
        stats["total_tokens"] = 7  # not load: waits for the heartbeat
        events.append(PageEventBatch(stored=frozenset({B})))
        await asyncio.sleep(0.1)
        # The events went at once; the board missed that report, so the next round sends them again.
        assert [pages for _, pages in sent[1:3]] == [PageEventBatch(stored=frozenset({B}))] * 2
        assert resent == [True]  # the board had lost track of this replica: it asked for a snapshot
        before = len(sent)
        stats["active_tasks"] = 1  # load goes at once
        await asyncio.sleep(0.1)
        assert len(sent) == before + 1 and sent[-1][0]["active_tasks"] == 1
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
