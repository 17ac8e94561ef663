"""`serve-app bench spec`: n-gram speculative decoding against none, two engines side by side in one run.

Workloads, each run on both engines in turn: one client on input-grounded chats (copy, quote or edit
the input: `grounded_chats`), one client on the first standard chat prompts, then each of `--concurrency` at once
on the standard chat prompts. Greedy throughout, so both engines give the same tokens (checked).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from serve_app.bench.engine_bench import run_engine_bench
from serve_app.bench.prompts import grounded_chats, make_prompts
from serve_app.bench.stats import BenchRow, format_table
from serve_app.engine.engine import InferenceEngine


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    concurrency: int
    max_tokens: int
    ignore_eos: bool


def _speculation(engine: InferenceEngine) -> dict[str, int]:
    return {k.removeprefix("spec_decode_"): v for k, v in engine.get_stats().items() if k.startswith("spec_decode_")}


def run_spec_bench(args) -> tuple[list[BenchRow], list[dict]]:
    speculative = {
        "method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max,
    }
    engines = {"no-spec": InferenceEngine(model=args.model), "ngram": InferenceEngine(model=args.model, speculative_config=speculative)}
    try:
        tokenizer = engines["no-spec"].tokenizer
        chats = [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in make_prompts(args.chat_requests)]
        workloads = [
            Workload("grounded", [tokenizer.encode_chat(c) for c in grounded_chats(args.grounded_requests)], 1,
                     args.grounded_max_tokens, ignore_eos=False),
            Workload("chat", chats[:8], 1, args.chat_max_tokens, ignore_eos=True),
            *(Workload("chat", chats, clients, args.chat_max_tokens, ignore_eos=True) for clients in args.concurrency),
        ]
        for engine in engines.values():
            run_engine_bench(engine, chats[:4], 4, 8, system="warmup")
        rows, summaries = [], []
        for workload in workloads:
            outputs = {}
            for label, engine in engines.items():
                before = _speculation(engine)
                row, outputs[label] = run_engine_bench(
                    engine, workload.prompts, workload.concurrency, workload.max_tokens,
                    system=f"{workload.name}/{label}", return_tokens=True, ignore_eos=workload.ignore_eos,
                )
                rows.append(row)
                counts = {k: v - before[k] for k, v in _speculation(engine).items()}
                if label == "ngram":
                    base = rows[-2]
                    summaries.append({
                        "workload": workload.name, "clients": workload.concurrency,
                        "tpot_p50_speedup": round(base.tpot_p50_s / row.tpot_p50_s, 3) if row.tpot_p50_s else 0.0,
                        "throughput_ratio": round(row.output_tok_s / base.output_tok_s, 3) if base.output_tok_s else 0.0,
                        "acceptance_rate": round(counts["accepted_tokens"] / counts["draft_tokens"], 3) if counts["draft_tokens"] else 0.0,
                        "tokens_per_verified_row": round(counts["emitted_tokens"] / counts["drafts"], 2) if counts["drafts"] else 0.0,
                        "backed_off_rows": counts["backed_off_rows"],
                        "same_tokens": outputs["ngram"] == outputs["no-spec"],
                    })
        return rows, summaries
    finally:
        for engine in engines.values():
            engine.shutdown()


def main(args) -> None:
    rows, summaries = run_spec_bench(args)
    print(format_table(rows))
    for summary in summaries:
        print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"rows": [row.as_dict() for row in rows], "summaries": summaries}, handle, indent=2)
