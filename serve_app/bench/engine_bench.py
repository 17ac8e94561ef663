"""`serve-app bench engine`: N prompts through the in-process engine with C in flight, M new tokens each."""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from serve_app.bench.prompts import make_prompts
from serve_app.bench.stats import BenchRow, RequestTiming, format_table
from serve_app.engine.engine import InferenceEngine
from serve_app.wire.outputs import StreamDelta
from serve_app.wire.requests import GenerateRequest


@dataclass
class _Clock:
    """Timestamps of one request's deltas, filled from the scheduler thread."""

    start: float
    stamps: list[float] = field(default_factory=list)
    tokens: int = 0

    def on_delta(self, delta: StreamDelta) -> None:
        """One stamp per token: a delta of several (speculative decoding) gives them all its time, so that the
        mean gap is the time per output token."""
        now = time.perf_counter()
        self.stamps.extend([now] * len(delta.token_ids))
        self.tokens += len(delta.token_ids)

    def timing(self) -> RequestTiming:
        ttft = self.stamps[0] - self.start if self.stamps else 0.0
        gaps = tuple(b - a for a, b in zip(self.stamps, self.stamps[1:]))
        return RequestTiming(ttft=ttft, gaps=gaps, output_tokens=self.tokens)


def run_engine_bench(
    engine: InferenceEngine,
    prompts: list[str] | list[list[int]],
    concurrency: int,
    max_tokens: int,
    system: str = "engine",
    return_tokens: bool = False,
    options: dict[str, Any] | None = None,
    options_of: Callable[[int], dict[str, Any]] | None = None,
    ignore_eos: bool = True,
):
    """Keep `concurrency` greedy requests in flight until every prompt has run; return the summary row.

    `options` go into every `GenerateRequest` (a `structured_output`, say), `options_of(i)` into the
    i-th one's (a LoRA adapter, say). With `return_tokens`, also return each prompt's generated token
    ids, in prompt order.
    """
    pending = list(reversed(prompts))
    slots = threading.Semaphore(concurrency)
    clocks: list[_Clock] = []
    results = []
    progress = tqdm(total=len(prompts), desc=f"{system} c={concurrency}", unit="req", leave=False)
    begin = time.perf_counter()
    while pending:
        slots.acquire()
        own = options_of(len(results)) if options_of is not None else {}
        request = GenerateRequest(
            prompt=pending.pop(), max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos, **(options or {}), **own
        )
        clock = _Clock(start=time.perf_counter())

        def on_delta(delta: StreamDelta, clock: _Clock = clock) -> None:
            clock.on_delta(delta)
            if delta.finish_reason is not None:
                slots.release()
                progress.update(1)

        clocks.append(clock)
        results.append(engine.submit(request, on_delta))
    outcomes = [result.wait() for result in results]
    duration = time.perf_counter() - begin
    progress.close()
    row = BenchRow.from_timings(system, concurrency, duration, [c.timing() for c in clocks])
    if return_tokens:
        return row, [list(o.token_ids) for o in outcomes]
    return row


def engine_form(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options that the benches' engine-form flags (`cli.parsing.add_engine_form`) set: the compiled
    forward, the weights and the KV cache's element type."""
    return {"compile": args.compile, "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype}


def main(args) -> None:
    engine = InferenceEngine(model=args.model, kv_cache=args.kv_cache, **engine_form(args))
    try:
        prompts = make_prompts(args.requests, seed=args.seed)
        run_engine_bench(engine, prompts[: min(4, len(prompts))], 4, 4, system="warmup")
        rows = [run_engine_bench(engine, prompts, c, args.max_tokens) for c in args.concurrency]
    finally:
        engine.shutdown()
    print(format_table(rows))
    for row in rows:
        print(json.dumps(row.as_dict()))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([row.as_dict() for row in rows], handle, indent=2)
