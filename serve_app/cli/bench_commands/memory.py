"""`serve-app bench memory`: where a serve run's memory goes, process by process, beside llama-server's."""

from __future__ import annotations

import argparse

from serve_app.cli.parsing import add_engine_form, str_list
from serve_app.config import DEFAULT_MODEL

NAME = "memory"
HELP = "where a serve run's memory goes, process by process (RSS and PSS), beside llama-server's on the same load"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    add_engine_form(parser)
    parser.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary, to measure beside")
    parser.add_argument("--gguf", type=str_list, default=[], help="GGUF files for llama-server, comma-separated")
    parser.add_argument("--json", default=None)


def run(args: argparse.Namespace) -> None:
    if args.gguf and not args.llama_server:
        raise SystemExit("serve-app bench memory: --gguf needs --llama-server PATH")
    from serve_app.bench.memory import main

    main(args)
