"""`serve-app bench <command>`: each command's options and how it runs, a module each (its bench's code is
imported only when it runs, so `--help` stays quick)."""

from __future__ import annotations

import argparse

from serve_app.cli.bench_commands import (
    abuse,
    batch,
    clients,
    compare,
    decode_kernel,
    engine,
    gpu_check,
    lora,
    memory,
    prefix,
    process_cpu,
    quant,
    random_model,
    route,
    serve,
    soak,
    spec,
    start,
    step_budget,
    structured,
    tiers,
)

COMMANDS = [engine, compare, serve, batch, prefix, tiers, spec, soak, abuse, start, process_cpu, memory, step_budget, decode_kernel, structured, lora, clients, quant, gpu_check, route, random_model]


def add_bench(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    for command in COMMANDS:
        parser = bench.add_parser(command.NAME, help=command.HELP)
        command.add_options(parser)
        parser.set_defaults(func=command.run)
