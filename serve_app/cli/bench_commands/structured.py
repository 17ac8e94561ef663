"""`serve-app bench structured`: the same requests with and without a JSON schema, in one run."""

from __future__ import annotations

import argparse

from serve_app.cli.parsing import int_list
from serve_app.config import DEFAULT_MODEL

NAME = "structured"
HELP = "the same requests with and without a JSON schema, in one run"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int_list, default=[64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="alternating pairs of runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)


def run(args: argparse.Namespace) -> None:
    from serve_app.bench.structured_bench import main

    main(args)
