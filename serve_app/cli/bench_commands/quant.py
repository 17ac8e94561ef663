"""`serve-app bench quant`: quantized weights against the unquantized model: greedy agreement, log-prob gap, tok/s."""

from __future__ import annotations

import argparse

from serve_app.cli.parsing import int_list, quantization_list, str_list
from serve_app.config import DEFAULT_MODEL

NAME = "quant"
HELP = "quantized weights and 16-bit KV caches against the unquantized model: greedy agreement, log-prob gap, tok/s"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--quantization", type=quantization_list, default=["int8"], help="the quantized weights to measure: int8, int4, fp8, or several comma-separated")
    parser.add_argument(
        "--kv-cache-dtype", type=str_list, default=[], help="16-bit KV caches to measure as well: bfloat16, float16"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", help="the unquantized model's dtype and the activations'")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int_list, default=[1, 64])
    parser.add_argument("--cache-tokens", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)


def run(args: argparse.Namespace) -> None:
    from serve_app.bench.quant_bench import main

    main(args)
