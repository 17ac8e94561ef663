"""`serve-app bench structured`: the same requests with and without a JSON schema, in one run.

It reports output tok/s of both (alternating, so that host drift hits both alike) and their
ratio, the cost of one step's logits mask at the benchmark's concurrency, and the compile time
of a schema the engine has not seen (xgrammar's first load apart).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from serve_app.bench.engine_bench import run_engine_bench
from serve_app.bench.prompts import make_prompts
from serve_app.bench.stats import format_table
from serve_app.engine.engine import InferenceEngine
from serve_app.wire.requests import StructuredOutput

# Open-ended enough that the model, not the grammar, decides the length (as in real use).
SCHEMA = {
    "type": "object",
    "properties": {
        "summary": {"type": "string", "maxLength": 200},
        "facts": {"type": "array", "items": {"type": "string", "maxLength": 80}},
    },
    "required": ["summary", "facts"],
}


def compile_seconds(engine: InferenceEngine) -> dict[str, float]:
    """xgrammar's first load, a new schema's compile, and the same schema again (cached)."""
    timings = {}
    for name, schema in [
        ("first_load_s", {"type": "object"}),
        ("new_schema_s", SCHEMA),
        ("cached_schema_s", SCHEMA),
    ]:
        start = time.perf_counter()
        engine.grammars.matcher(StructuredOutput(json=schema))
        timings[name] = round(time.perf_counter() - start, 6)  # a cached schema takes tens of microseconds
    return timings


def mask_seconds(engine: InferenceEngine, rows: int, repeats: int = 20) -> float:
    """Median time to fill and apply the bitmask of `rows` constrained rows (one step's mask)."""
    matchers = [engine.grammars.matcher(StructuredOutput(json=SCHEMA)) for _ in range(rows)]
    logits = torch.randn(rows, engine.runner.vocab_size)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.grammars.mask(logits, matchers)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(args: argparse.Namespace) -> None:
    engine = InferenceEngine(model=args.model)
    constrained = {"structured_output": StructuredOutput(json=SCHEMA)}
    try:
        compile_times = compile_seconds(engine)
        prompts = make_prompts(args.requests, seed=args.seed)
        # Every prompt once first, so that every measured run finds them in the prefix cache alike.
        run_engine_bench(engine, prompts, max(args.concurrency), 1, system="warmup")
        rows = []
        mask_s = {}
        for concurrency in args.concurrency:
            for _ in range(args.repeats):
                rows.append(run_engine_bench(engine, prompts, concurrency, args.max_tokens, system="unconstrained"))
                rows.append(
                    run_engine_bench(engine, prompts, concurrency, args.max_tokens, system="json-schema", options=constrained)
                )
            mask_s[concurrency] = mask_seconds(engine, concurrency)
    finally:
        engine.shutdown()
    print(format_table(rows))
    plain = [r.output_tok_s for r in rows if r.system == "unconstrained"]
    schema = [r.output_tok_s for r in rows if r.system == "json-schema"]
    ratios = [round(s / p, 3) for s, p in zip(schema, plain)]
    report = {
        "rows": [r.as_dict() for r in rows],
        "json_schema_over_unconstrained_tok_s": ratios,
        **{f"mask_ms_per_step_at_{rows_}_rows": round(seconds * 1000, 3) for rows_, seconds in mask_s.items()},
        **compile_times,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=2))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
