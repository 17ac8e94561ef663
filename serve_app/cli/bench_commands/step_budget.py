"""`serve-app bench step-budget`: one client in process: where a token's time goes, the forward's operators."""

from __future__ import annotations

import argparse

from serve_app.cli.parsing import add_engine_form
from serve_app.config import DEFAULT_MODEL

NAME = "step-budget"
HELP = "one client in process: where a token's time goes (the step's parts, the forward's operators)"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, default=128, help="output tokens of each timed request")
    parser.add_argument("--requests", type=int, default=3, help="requests timed one after another")
    add_engine_form(parser)
    parser.add_argument("--json", default=None)


def run(args: argparse.Namespace) -> None:
    from serve_app.bench.step_budget import main

    main(args)
