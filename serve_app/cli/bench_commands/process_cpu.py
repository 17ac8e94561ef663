"""`serve-app bench process-cpu`: streaming clients against serve run: CPU each process spends per generated token."""

from __future__ import annotations

import argparse

from serve_app.cli.parsing import add_engine_form, int_list
from serve_app.config import DEFAULT_MODEL

NAME = "process-cpu"
HELP = "streaming clients against serve run: CPU each process spends per generated token"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--concurrency", type=int_list, default=[1])
    parser.add_argument("--max-tokens", type=int, default=64)
    add_engine_form(parser)
    parser.add_argument("--json", default=None)


def run(args: argparse.Namespace) -> None:
    from serve_app.bench.process_cpu import main

    main(args)
