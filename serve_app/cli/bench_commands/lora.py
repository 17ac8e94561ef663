"""`serve-app bench lora`: the base model alone against the base and LoRA adapters in even shares."""

from __future__ import annotations

import argparse

from serve_app.cli.parsing import add_engine_form, int_list
from serve_app.config import DEFAULT_MODEL

NAME = "lora"
HELP = "the base model alone against the base and LoRA adapters in even shares"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--adapters", type=int, default=4, help="LoRA adapters, written at random and served in even shares with the base")
    parser.add_argument("--rank", type=int, default=8, help="the adapters' rank")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int_list, default=[64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="alternating pairs of runs")
    parser.add_argument("--seed", type=int, default=0)
    add_engine_form(parser)
    parser.add_argument("--json", default=None)


def run(args: argparse.Namespace) -> None:
    from serve_app.bench.lora_bench import main

    main(args)
