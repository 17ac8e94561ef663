"""`serve-app bench decode-kernel`: the paged decode-attention kernel on one layer's call, caches warm and cold."""

from __future__ import annotations

import argparse

from serve_app.cli.parsing import str_list

NAME = "decode-kernel"
HELP = "the paged decode-attention kernel on one layer's call, caches warm and cold"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="take the heads, key/value heads and head dimension from this model's config"
    )
    parser.add_argument("--rows", type=int, default=64, help="decode rows (requests) in the call")
    parser.add_argument("--heads", type=int, default=9, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=3, help="key/value heads")
    parser.add_argument("--head-dim", type=int, default=64, help="dimension of a head")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=50, help="tokens each row attends to")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads")
    parser.add_argument(
        "--kv-dtype", type=str_list, default=["float32"], help="the pages' element types to time: float32, bfloat16, float16"
    )
    parser.add_argument("--calls", type=int, default=100, help="calls timed per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--against", default=None, help="another paged_decode.c to time alongside")
    parser.add_argument("--json", default=None)


def run(args: argparse.Namespace) -> None:
    from serve_app.bench.decode_kernel_bench import main

    main(args)
