"""`serve-app bench serve`: load a running server: a concurrency sweep or a Poisson request rate."""

from __future__ import annotations

import argparse

from serve_app.cli.parsing import int_list

NAME = "serve"
HELP = "load a running server: a concurrency sweep or a Poisson request rate"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's URL, without /v1")
    parser.add_argument("--model", default=None, help="the served model name (asked from /v1/models by default)")
    parser.add_argument("--concurrency", type=int_list, default=[1, 8, 32])
    parser.add_argument("--rate", type=float, default=None, help="requests per second (Poisson) instead of a sweep")
    parser.add_argument("--requests", type=int, default=64, help="stop after this many requests")
    parser.add_argument("--duration", type=float, default=120.0, help="stop issuing after this many seconds")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)


def run(args: argparse.Namespace) -> None:
    from serve_app.bench.serve_bench import main

    main(args)
