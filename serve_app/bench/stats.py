"""Latency and throughput summaries shared by the benchmarks."""

from __future__ import annotations

import resource
from collections.abc import Sequence
from dataclasses import asdict, dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@dataclass(frozen=True)
class RequestTiming:
    """One request: seconds to its first token, gaps between later tokens, and tokens produced; over HTTP
    also the gaps between the stream's chunks as they arrived (a chunk may carry several tokens)."""

    ttft: float
    gaps: tuple[float, ...]
    output_tokens: int
    chunk_gaps: tuple[float, ...] = ()


@dataclass(frozen=True)
class BenchRow:
    system: str
    concurrency: int
    requests: int
    output_tokens: int
    duration_s: float
    output_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    peak_rss_mb: float

    @classmethod
    def from_timings(cls, system: str, concurrency: int, duration: float, timings: Sequence[RequestTiming]) -> BenchRow:
        tokens = sum(t.output_tokens for t in timings)
        ttfts = [t.ttft for t in timings]
        tpots = [sum(t.gaps) / len(t.gaps) for t in timings if t.gaps]
        return cls(
            system=system,
            concurrency=concurrency,
            requests=len(timings),
            output_tokens=tokens,
            duration_s=round(duration, 3),
            output_tok_s=round(tokens / duration, 2) if duration > 0 else 0.0,
            ttft_p50_s=round(percentile(ttfts, 50), 4),
            ttft_p99_s=round(percentile(ttfts, 99), 4),
            tpot_p50_s=round(percentile(tpots, 50), 4),
            tpot_p99_s=round(percentile(tpots, 99), 4),
            peak_rss_mb=round(peak_rss_mb(), 1),
        )

    def as_dict(self) -> dict:
        return asdict(self)


def format_table(rows: Sequence[BenchRow]) -> str:
    """A plain-text table of rows, one line each."""
    header = ["system", "conc", "reqs", "tokens", "secs", "tok/s", "ttft p50", "ttft p99", "tpot p50", "tpot p99", "rss MB"]
    lines = [header] + [
        [
            r.system, str(r.concurrency), str(r.requests), str(r.output_tokens), f"{r.duration_s:.2f}",
            f"{r.output_tok_s:.1f}", f"{r.ttft_p50_s:.3f}", f"{r.ttft_p99_s:.3f}", f"{r.tpot_p50_s:.4f}",
            f"{r.tpot_p99_s:.4f}", f"{r.peak_rss_mb:.0f}",
        ]
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in lines)


def dict_table(rows: Sequence[dict[str, object]]) -> str:
    """A plain-text table of rows of the same keys (the header), one line each, right-aligned."""
    header = list(rows[0])
    lines = [header] + [[str(row[key]) for key in header] for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in lines)
