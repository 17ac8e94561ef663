"""`serve-app bench engine`: the in-process engine: throughput, TTFT and TPOT."""

from __future__ import annotations

import argparse

from serve_app.cli.parsing import add_engine_form, int_list
from serve_app.config import DEFAULT_MODEL

NAME = "engine"
HELP = "the in-process engine: throughput, TTFT and TPOT"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--kv-cache", default="paged", choices=["paged", "contiguous"], help="the KV cache: paged (pages shared by prefix) or contiguous (a slot per request)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int_list, default=[16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    add_engine_form(parser)


def run(args: argparse.Namespace) -> None:
    from serve_app.bench.engine_bench import main

    main(args)
