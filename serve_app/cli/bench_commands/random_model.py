"""`serve-app bench random-model`: a Llama-shaped 1B model of random weights, and its GGUFs for llama-server."""

from __future__ import annotations

import argparse

from serve_app.config import DEFAULT_MODEL

NAME = "random-model"
HELP = "a Llama-shaped 1B model of random weights (made once), and with --llama-cpp its GGUFs for llama-server"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="the model whose tokenizer (and vocabulary size) the random one takes"
    )
    parser.add_argument("--name", default="llama-1b-random", help="its folder's name under <cache dir>/models/bench")
    parser.add_argument("--seed", type=int, default=0, help="seed of its random weights")
    parser.add_argument(
        "--llama-cpp", default=None,
        help="a llama.cpp source tree with build/bin/llama-quantize: also make F32, Q8_0 and Q4_1 GGUFs beside it",
    )


def run(args: argparse.Namespace) -> None:
    from serve_app.bench.random_model import main

    main(args)
