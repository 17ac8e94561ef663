"""A small soak through the shared `serve run`: every request completes, is refused in shape, or was hung up on."""

from __future__ import annotations

from serve_app.bench.servers import ServeRun
from serve_app.bench.soak import memory_growth_mb, run_soak


def test_soak_rounds_end_idle_with_every_page_back(served: ServeRun) -> None:
    reports = run_soak(served, clients=12, duration=8.0, rounds=3, max_tokens=16, deadline_s=60.0)
    for report in reports:
        assert report.problems == [], report
        assert report.pages_back
        assert {"completed", "hung up", "refused"} <= set(report.outcomes), report.outcomes
    assert memory_growth_mb(reports) < 200, [r.rss_mb for r in reports]
