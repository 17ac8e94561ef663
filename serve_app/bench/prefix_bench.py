"""`serve-app bench prefix`: requests sharing a long system prompt, cold then warm, prefix caching on and off."""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict

from serve_app.bench.prompts import long_passage
from serve_app.bench.stats import BenchRow, RequestTiming, format_table
from serve_app.engine.engine import InferenceEngine
from serve_app.wire.requests import GenerateRequest

QUESTIONS = [
    "What is the main topic?", "Summarise it in one line.", "Which word appears most?", "Is it a story?",
    "Give it a title.", "Who would read this?", "What comes next?", "Name one detail.",
]


def _ttft(engine: InferenceEngine, messages: list[dict], max_tokens: int) -> RequestTiming:
    start = time.perf_counter()
    stamps: list[float] = []
    request = GenerateRequest(messages=messages, max_tokens=max_tokens, temperature=0, ignore_eos=True)
    result = engine.submit(request, lambda delta: stamps.append(time.perf_counter()) if delta.token_ids else None).wait()
    gaps = tuple(b - a for a, b in zip(stamps, stamps[1:]))
    return RequestTiming(ttft=stamps[0] - start, gaps=gaps, output_tokens=len(result.token_ids))


def run_prefix_bench(model: str, system_tokens: int, warm_requests: int, max_tokens: int, seed: int = 0) -> list[BenchRow]:
    rows = []
    for caching in (True, False):
        engine = InferenceEngine(model=model, enable_prefix_caching=caching, cache_tokens=16384)
        try:
            system = long_passage(engine.tokenizer, system_tokens, random.Random(seed))
            label = "prefix-on" if caching else "prefix-off"
            cold_start = time.perf_counter()
            cold = _ttft(engine, [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[0]}], max_tokens)
            rows.append(BenchRow.from_timings(f"{label}-cold", 1, time.perf_counter() - cold_start, [cold]))
            warm_start = time.perf_counter()
            warm = [
                _ttft(engine, [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], max_tokens)
                for i in range(1, warm_requests + 1)
            ]
            rows.append(BenchRow.from_timings(f"{label}-warm", 1, time.perf_counter() - warm_start, warm))
        finally:
            engine.shutdown()
    return rows


def main(args) -> None:
    rows = run_prefix_bench(args.model, args.system_tokens, args.warm_requests, args.max_tokens, args.seed)
    print(format_table(rows))
    by_name = {row.system: row for row in rows}
    for label in ("prefix-on", "prefix-off"):
        cold, warm = by_name[f"{label}-cold"], by_name[f"{label}-warm"]
        print(f"{label}: warm TTFT p50 / cold TTFT = {warm.ttft_p50_s / cold.ttft_p50_s:.3f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([asdict(row) for row in rows], handle, indent=2)
