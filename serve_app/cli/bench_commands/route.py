"""`serve-app bench route`: the prefix-aware router against Serve's default: two live engine replicas, or simulated
ones."""

from __future__ import annotations

import argparse

from serve_app.cli.parsing import int_list
from serve_app.config import DEFAULT_MODEL

NAME = "route"
HELP = "the prefix-aware router against Serve's default: two live engine replicas, or simulated ones"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the model of the live replicas")
    parser.add_argument("--simulate", action="store_true", help="no model: N simulated replicas (page caches, service times)")
    parser.add_argument("--tenants", type=int, default=None, help="default: 4 live, 16 simulated")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--balance-abs-threshold", type=int, default=4, help="the router's load balance: a replica this many requests busier than the least loaded is skipped")
    parser.add_argument("--balance-rel-threshold", type=float, default=1.5, help="and one this many times as busy")
    parser.add_argument("--min-match-ratio", type=float, default=0.5, help="the share of a prompt's pages a replica must hold to be preferred for it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    live = parser.add_argument_group("live (two engine replicas under serve run)")
    live.add_argument("--conversations", type=int, default=24)
    live.add_argument("--rate", type=float, default=0.25, help="new conversations per second (Poisson arrivals)")
    live.add_argument("--think-s", type=float, default=2.0, help="mean pause before a conversation's next turn")
    live.add_argument("--system-words", type=int, default=300, help="words of each conversation's system prompt")
    live.add_argument("--user-words", type=int, default=120, help="words of each user turn")
    live.add_argument("--max-tokens", type=int, default=32, help="new tokens per turn (EOS ignored)")
    live.add_argument(
        "--cache-tokens", type=int, default=32768, help="each routed replica's KV cache (the one replica has both's)"
    )
    live.add_argument("--max-model-len", type=int, default=2048)
    simulated = parser.add_argument_group("--simulate")
    simulated.add_argument("--replicas", type=int_list, default=[2, 8, 64], help="simulated replica counts; a comma list sweeps")
    simulated.add_argument("--conversations-per-replica", type=int, default=32, help="conversations per simulated replica")
    simulated.add_argument("--arrival-rate-per-replica", type=float, default=1.0, help="new conversations per second")
    simulated.add_argument("--cache-pages", type=int, default=2048, help="pages per simulated replica")
    simulated.add_argument("--page-size", type=int, default=16)


def run(args: argparse.Namespace) -> None:
    if args.simulate:
        from serve_app.bench.route_sim import main
    else:
        from serve_app.bench.route_bench import main

    main(args)
