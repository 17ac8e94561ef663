"""Timings of request-stream passes: `StreamPerfMetrics` per pass, `Metrics` per batched phase."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO


@dataclass(frozen=True)
class StreamPerfMetrics:
    """One pass, in seconds. `input_tput` is prompt tokens per second of time to first token;
    `output_tput` is generated tokens per second after the first (0 with fewer than two)."""

    duration: float
    input_tokens: int
    output_tokens: int
    input_tput: float
    output_tput: float
    tpot: list[float] = field(default_factory=list)
    ttft: float = 0.0

    @classmethod
    def from_stamps(cls, start: float, stamps: Sequence[float], end: float, input_tokens: int) -> StreamPerfMetrics:
        """From a pass's start, the arrival time of each generated token, and its end."""
        ttft = stamps[0] - start if stamps else end - start
        decode = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
        return cls(
            duration=end - start,
            input_tokens=input_tokens,
            output_tokens=len(stamps),
            input_tput=input_tokens / ttft if ttft > 0 else 0.0,
            output_tput=(len(stamps) - 1) / decode if decode > 0 else 0.0,
            tpot=[b - a for a, b in zip(stamps, stamps[1:])],
            ttft=ttft,
        )


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


@dataclass(frozen=True)
class Metrics:
    """One phase (prefill, modify or decode) of a `BatchedStream`: every stream's pass, and the wall time."""

    phase: str
    wall_s: float
    streams: dict[str, StreamPerfMetrics]

    @property
    def input_tokens(self) -> int:
        return sum(m.input_tokens for m in self.streams.values())

    @property
    def output_tokens(self) -> int:
        return sum(m.output_tokens for m in self.streams.values())

    def to_dict(self) -> dict[str, Any]:
        passes = list(self.streams.values())
        return {
            "phase": self.phase,
            "streams": len(passes),
            "wall_s": self.wall_s,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "input_tok_s": self.input_tokens / self.wall_s if self.wall_s > 0 else 0.0,
            "output_tok_s": self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0,
            "ttft_p50_s": _median([m.ttft for m in passes]),
            "tpot_p50_s": _median([gap for m in passes for gap in m.tpot]),
            "per_stream": {key: asdict(m) for key, m in self.streams.items()},
        }

    def emit(self, out: TextIO | None = None) -> None:
        """Print the phase as a small table (to stdout by default)."""
        out = out or sys.stdout
        data = self.to_dict()
        rows = [
            ("streams", f"{data['streams']}"),
            ("wall time", f"{data['wall_s']:.3f} s"),
            ("input tokens", f"{data['input_tokens']}  ({data['input_tok_s']:.1f} tok/s)"),
            ("output tokens", f"{data['output_tokens']}  ({data['output_tok_s']:.1f} tok/s)"),
            ("TTFT p50", f"{1000 * data['ttft_p50_s']:.1f} ms"),
            ("TPOT p50", f"{1000 * data['tpot_p50_s']:.1f} ms"),
        ]
        width = max(len(name) for name, _ in rows)
        print(f"== {self.phase} ==", file=out)
        for name, value in rows:
            print(f"  {name:<{width}}  {value}", file=out)
