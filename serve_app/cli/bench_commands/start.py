"""`serve-app bench start`: serve run to its first answer: eager, compiled with an empty compile cache, then with a
warm one."""

from __future__ import annotations

import argparse

from serve_app.config import DEFAULT_MODEL

NAME = "start"
HELP = "serve run to its first answer: eager, compiled with an empty compile cache, then with a warm one"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=2, help="eager and warm compiled starts, alternating, after the cold one")
    parser.add_argument("--json", default=None)


def run(args: argparse.Namespace) -> None:
    from serve_app.bench.start_bench import main

    main(args)
