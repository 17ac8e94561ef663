"""`serve-app bench compare`: this engine and server against transformers, side by side."""

from __future__ import annotations

import argparse

from serve_app.cli.parsing import int_list, str_list
from serve_app.config import DEFAULT_MODEL

NAME = "compare"
HELP = "this engine and server against transformers, side by side"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--concurrency", type=int_list, default=[1, 16, 64, 128], help="requests in flight for engine and the HTTP systems; a comma list sweeps, e.g. 1,8,32"
    )
    parser.add_argument(
        "--systems", type=str_list, default=None,
        help="comma list of engine,hf-sequential,hf-static,hf-generate-batch,http,http-int8,http-int4,http-kv16,"
        "http-int4-kv16,http-eager,http-int8-eager,llama-server",
    )
    parser.add_argument(
        "--workloads", type=str_list, default=["completions", "chat"],
        help="what the HTTP systems and llama-server run: completions (token-id prompts), chat (short chats "
        "through each server's chat template), or both",
    )
    parser.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary: adds that system")
    parser.add_argument("--gguf", action="append", default=[], help="a GGUF for llama-server (repeat for several)")
    parser.add_argument("--device", default="cpu", help="where the in-process systems run: cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="float32", help="their dtype: float32, bfloat16, float16")
    parser.add_argument("--sequential-requests", type=int, default=8, help="requests for one-at-a-time generate (it is slow)")
    parser.add_argument("--single-client-requests", type=int, default=16, help="requests at concurrency 1 (it is slow)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="write a PNG plot here")


def run(args: argparse.Namespace) -> None:
    from serve_app.bench.compare import main

    main(args)
