"""`serve-app bench soak`: many streaming clients (some hanging up, some malformed) against serve run."""

from __future__ import annotations

import argparse

from serve_app.config import DEFAULT_MODEL

NAME = "soak"
HELP = "many streaming clients (some hanging up, some malformed) against serve run"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--concurrency", type=int, default=48, help="streaming clients at once (one number: the rounds compare memory at one load)"
    )
    parser.add_argument("--duration", type=float, default=120.0, help="seconds per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--deadline", type=float, default=120.0, help="a request taking longer is a hang")
    parser.add_argument("--max-growth-mb", type=float, default=200.0, help="allowed memory growth after the first round")
    parser.add_argument("--json", default=None)


def run(args: argparse.Namespace) -> None:
    from serve_app.bench.soak import main

    main(args)
