"""`serve-app bench tiers`: TTFT of a long prefix recomputed and from each KV tier; conversations overflowing the
pool, tiers on and off (a two-raylet Ray cluster on this host)."""

from __future__ import annotations

import argparse

from serve_app.config import DEFAULT_MODEL

NAME = "tiers"
HELP = (
    "TTFT of a long prefix recomputed and from each KV tier; conversations "
    "overflowing the pool, tiers on and off (a two-raylet Ray cluster on this host)"
)


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prefix-tokens", type=int, default=3000, help="length of each shared document")
    parser.add_argument("--documents", type=int, default=3, help="documents per case (TTFT p50 over them)")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1500, help="each conversation's system prompt")
    parser.add_argument("--pool-tokens", type=int, default=4096, help="the pool of the conversations' engines")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json", default=None)


def run(args: argparse.Namespace) -> None:
    from deployments.kv_tiers.bench import main  # it starts a Ray cluster: Ray is deployments/' business

    main(args)
