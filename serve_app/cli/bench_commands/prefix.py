"""`serve-app bench prefix`: a shared long system prompt: cold then warm, prefix caching on and off."""

from __future__ import annotations

import argparse

from serve_app.config import DEFAULT_MODEL

NAME = "prefix"
HELP = "a shared long system prompt: cold then warm, prefix caching on and off"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--system-tokens", type=int, default=1000, help="length of the shared system prompt")
    parser.add_argument("--warm-requests", type=int, default=6, help="requests that reuse the cached system prompt")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)


def run(args: argparse.Namespace) -> None:
    from serve_app.bench.prefix_bench import main

    main(args)
