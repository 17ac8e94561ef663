"""`serve-app bench abuse`: a victim tenant streams while an attacker tenant sends each costly or malformed shape."""

from __future__ import annotations

import argparse

from serve_app.config import DEFAULT_MODEL

NAME = "abuse"
HELP = "a victim tenant streams chats while an attacker tenant sends each costly or malformed request shape"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of the baseline and of each shape")
    parser.add_argument("--shapes", default="", help="comma-separated shape names (default: every one)")
    parser.add_argument("--victims", type=int, default=4, help="the victim's streaming clients")
    parser.add_argument("--attackers", type=int, default=2, help="the attacker's clients, each sending its shape in a loop")
    parser.add_argument(
        "--attacker-rate", type=float, default=5.0, help="requests a second per attacker client (0: back to back, a flood)"
    )
    parser.add_argument("--period", type=float, default=1.0, help="seconds between the starts of one victim client's chats")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per victim chat")
    parser.add_argument("--answer-deadline", type=float, default=5.0, help="an attacker request answered later misses the target")
    parser.add_argument("--max-ttft-ratio", type=float, default=2.0, help="the victim's TTFT p99 over its baseline's at most")
    parser.add_argument("--json", default=None)


def run(args: argparse.Namespace) -> None:
    from serve_app.bench.abuse import main

    main(args)
