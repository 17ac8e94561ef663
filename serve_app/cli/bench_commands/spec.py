"""`serve-app bench spec`: n-gram speculative decoding against none, side by side: one client on input-grounded
chats, then many on the standard chat prompts."""

from __future__ import annotations

import argparse

from serve_app.cli.parsing import int_list
from serve_app.config import DEFAULT_MODEL

NAME = "spec"
HELP = (
    "n-gram speculative decoding against none, side by side: one client on "
    "input-grounded chats, then many on the standard chat prompts"
)


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--grounded-requests", type=int, default=16, help="chats that copy, quote or edit their input")
    parser.add_argument("--grounded-max-tokens", type=int, default=128, help="new tokens per grounded chat")
    parser.add_argument("--chat-requests", type=int, default=128, help="standard chats")
    parser.add_argument("--chat-max-tokens", type=int, default=64, help="new tokens per standard chat")
    parser.add_argument(
        "--concurrency", type=int_list, default=[64], help="requests in flight on the standard chats; a comma list sweeps"
    )
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="tokens proposed per step")
    parser.add_argument("--prompt-lookup-min", type=int, default=2, help="shortest n-gram matched in the context")
    parser.add_argument("--prompt-lookup-max", type=int, default=5, help="longest n-gram matched in the context")
    parser.add_argument("--json", default=None)


def run(args: argparse.Namespace) -> None:
    from serve_app.bench.spec_bench import main

    main(args)
