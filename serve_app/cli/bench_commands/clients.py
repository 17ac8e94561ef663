"""`serve-app bench clients`: client libraries' structured-output and tool cases against running servers, side by
side."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from serve_app.config import DEFAULT_MODEL

if TYPE_CHECKING:
    from serve_app.bench.clients_bench import Server

NAME = "clients"
HELP = "client libraries' structured-output and tool cases against running servers, side by side"


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server", action="append", required=True, metavar="NAME=URL[=MODEL]",
        help="a server to run every case against (repeat it): its column name, its URL without /v1, and the model "
        "it serves where that is not --model",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the model the servers serve, by the name they give it")


def servers_of(specs: list[str], model: str) -> list[Server]:
    """The `Server`s that `--server NAME=URL[=MODEL]` options name; a server naming no model serves `model`."""
    from serve_app.bench.clients_bench import Server

    servers = []
    for spec in specs:
        parts = spec.split("=", 2)
        if len(parts) < 2 or not all(parts):
            raise SystemExit(f"--server {spec!r}: expected NAME=URL or NAME=URL=MODEL")
        servers.append(Server(parts[0], parts[1], parts[2] if len(parts) == 3 else model))
    return servers


def run(args: argparse.Namespace) -> None:
    from serve_app.bench.clients_bench import run

    print(run(servers_of(args.server, args.model)))
