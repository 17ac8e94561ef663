"""`serve-app bench gpu-check`: on an accelerator: the greedy oracle per dtype, bench compare, then int8 and fp8
weights there."""

from __future__ import annotations

import argparse

from serve_app.cli.parsing import int_list, quantization_list, str_list
from serve_app.config import DEFAULT_MODEL

NAME = "gpu-check"
HELP = "on an accelerator: the greedy oracle per dtype, bench compare, then int8 and fp8 weights there"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtypes", type=str_list, default=["float32", "bfloat16"], help="the oracle's dtypes")
    parser.add_argument("--oracle-requests", type=int, default=16, help="requests of the greedy oracle")
    parser.add_argument("--oracle-max-tokens", type=int, default=32, help="new tokens per oracle request")
    parser.add_argument("--bench-requests", type=int, default=256, help="requests of bench compare")
    parser.add_argument("--bench-max-tokens", type=int, default=64, help="new tokens per request in bench compare")
    parser.add_argument("--bench-dtype", default="bfloat16", help="the dtype of bench compare's in-process systems")
    parser.add_argument("--concurrency", type=int_list, default=[1, 64, 256])
    parser.add_argument(
        "--quantization", type=quantization_list, default=["int8", "fp8"], help="weights measured last, as bench quant"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)


def run(args: argparse.Namespace) -> None:
    from serve_app.bench.gpu_check import main

    main(args)
