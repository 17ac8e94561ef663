"""Token dropping with the KV SDK: prefill long prompts, drop the middle half of each cached prefix, decode.

Each prompt's cached KV is cut to its first and last quarter of pages; K of the kept pages is
re-rotated to the compacted positions and stored under the shorter token list; decoding then
continues from the shorter cache. The same prompts also run without dropping (under another
cache salt, so neither run reuses the other's cache), and the decode speed-up is printed.

    python examples/token_dropping.py --url http://127.0.0.1:8000 --prompts 4 --prompt-tokens 3000
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

from serve_app.bench.prompts import long_passage
from serve_app.config import DEFAULT_MODEL, default_cache_dir
from serve_app.kvsdk import (
    BatchedStream,
    KVConfig,
    Metrics,
    connect,
    create_request,
    make_post_completion,
    rerotate_k,
)
from serve_app.model.loader import resolve_model_path
from serve_app.model.tokenizer import Tokenizer


def drop_middle(config: KVConfig):
    """A modify function keeping the first and last quarter of the pages, K moved to the new positions."""

    def modify(kv: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
        size = config.page_size
        n_pages = len(tokens) // size
        quarter = max(1, n_pages // 4)
        kept_pages = [*range(quarter), *range(max(quarter, n_pages - quarter), n_pages)]
        kept = [p * size + i for p in kept_pages for i in range(size)]
        compact = rerotate_k(kv[:, :, kept], kept, range(len(kept)), config)
        return compact, [tokens[i] for i in kept]

    return modify


def make_prompts(tokenizer: Tokenizer, count: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        tokenizer.encode(f"Notes, part {i + 1}:\n{long_passage(tokenizer, tokens, rng)}\nIn one sentence, the notes say")
        for i in range(count)
    ]


def run(url: str, prompts: list[list[int]], max_tokens: int, drop: bool) -> tuple[list[Metrics], BatchedStream]:
    context = connect(url)
    post = make_post_completion(url)
    salt = "dropped" if drop else "full"
    batch = BatchedStream(create_request(context, post, ids, cache_salt=f"{salt}-{i}") for i, ids in enumerate(prompts))
    params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    phases = [batch.prefill({"temperature": 0, "ignore_eos": True})]
    if drop:
        phases.append(batch.modify(drop_middle(context.config)))
    phases.append(batch.decode(params))
    return phases, batch


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)

    tokenizer = Tokenizer(resolve_model_path(DEFAULT_MODEL, default_cache_dir()))
    prompts = make_prompts(tokenizer, args.prompts, args.prompt_tokens, args.seed)
    report: dict = {"prompt_tokens": [len(p) for p in prompts]}
    for drop in (False, True):
        name = "with dropping" if drop else "without dropping"
        print(f"\n# {name}")
        phases, batch = run(args.url, prompts, args.max_tokens, drop)
        for phase in phases:
            phase.emit()
        report[name] = {
            "phases": [phase.to_dict() for phase in phases],
            "context_tokens": [len(batch.get_request_stream(key).tokens) for key in phases[-1].streams],
            "outputs": [batch.get_request_stream(key).output_text for key in phases[-1].streams],
        }
    full, dropped = (report[name]["phases"][-1] for name in ("without dropping", "with dropping"))
    report["decode_speedup"] = full["tpot_p50_s"] / dropped["tpot_p50_s"] if dropped["tpot_p50_s"] else 0.0
    print(f"\ndecode TPOT p50: {1000 * full['tpot_p50_s']:.1f} ms without dropping, "
          f"{1000 * dropped['tpot_p50_s']:.1f} ms with: {report['decode_speedup']:.2f}x faster")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
