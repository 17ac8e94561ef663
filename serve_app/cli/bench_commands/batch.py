"""`serve-app bench batch`: `serve-app batch` and the Batch API beside online serving, on this host, in one run."""

from __future__ import annotations

import argparse

from serve_app.cli.parsing import int_list
from serve_app.config import DEFAULT_MODEL

NAME = "batch"
HELP = "offline batch throughput against the best online one, and an online client's TTFT beside a Batch-API batch"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="an embedded model name or a local folder")
    parser.add_argument("--prompts", type=int, default=2000, help="the batch's prompts (the standard set)")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (EOS ignored)")
    parser.add_argument("--online-concurrency", type=int_list, default=[64, 128], help="the online loads, in clients")
    parser.add_argument("--online-requests", type=int, default=256, help="requests per online load")
    parser.add_argument("--ttft-requests", type=int, default=24, help="the online client's requests, alone and beside")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the report here")


def run(args: argparse.Namespace) -> None:
    from serve_app.bench.batch_bench import main

    main(args)
