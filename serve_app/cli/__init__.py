"""The `serve-app` console script: `serve` (the app, as `serve run` runs it), `batch` (an offline batch on Ray
Data), `prepare-model` and the `bench` commands (one module each, in `bench_commands`)."""

from __future__ import annotations

import argparse
import logging

from serve_app.cli.app_commands import add_prepare_model, add_serve
from serve_app.cli.batch_command import add_batch
from serve_app.cli.bench_commands import add_bench
from serve_app.cli.parsing import Parser


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="serve-app", description="An LLM inference server and its tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve(commands)
    add_batch(commands)
    add_prepare_model(commands)
    add_bench(commands)
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    args.func(args)
