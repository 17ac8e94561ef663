"""`serve-app bench clients`: client libraries' structured-output and tool cases against running servers, side by
side."""

from __future__ import annotations

import argparse

NAME = "clients"
HELP = "client libraries' structured-output and tool cases against running servers, side by side"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server", action="append", required=True, metavar="NAME=URL=MODEL",
        help="a server to run every case against (repeat it): its column name, its URL without /v1, the model it serves",
    )


def run(args: argparse.Namespace) -> None:
    from serve_app.bench.clients_bench import Server, run

    servers = [Server(*spec.split("=", 2)) for spec in args.server]
    print(run(servers))
