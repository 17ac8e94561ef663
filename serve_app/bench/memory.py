"""`serve-app bench memory`: where a fresh `serve run`'s memory goes, process by process (the engine's own,
the replicas, Serve's and Ray's daemons), after streaming clients have filled some of its KV cache; and,
given llama.cpp's `llama-server` and GGUF files, each of those on the same load, side by side.

Each process's resident set (RSS) counts the pages it shares (libraries, Ray's object store) once per
process that maps them, so the sum of RSS overstates a process tree; its proportional set (PSS) splits each
shared page among the processes that map it, so the sum of PSS is what the tree holds. Both are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from serve_app.bench.engine_bench import engine_form
from serve_app.bench.process_cpu import role_of
from serve_app.bench.servers import LlamaServer, ServeRun, served_id
from serve_app.bench.systems import stream_requests


@dataclass(frozen=True)
class ProcessMemory:
    """One process's memory, in MiB: resident, proportional (shared pages split), and its own (unshared)."""

    role: str
    pid: int
    rss_mib: float
    pss_mib: float
    uss_mib: float


@dataclass(frozen=True)
class SystemMemory:
    system: str
    processes: list[ProcessMemory]

    @property
    def rss_mib(self) -> float:
        return sum(p.rss_mib for p in self.processes)

    @property
    def pss_mib(self) -> float:
        return sum(p.pss_mib for p in self.processes)


def measure(system: str, root_pid: int) -> SystemMemory:
    """The memory of the process `root_pid` and of every process under it, the largest first."""
    root = psutil.Process(root_pid)
    rows = []
    for process in [root, *root.children(recursive=True)]:
        try:
            with process.oneshot():
                full = process.memory_full_info()
                role = role_of(process.cmdline(), process.name())
        except psutil.Error:  # gone in the meantime
            continue
        rows.append(ProcessMemory(role, process.pid, full.rss / 2**20, full.pss / 2**20, full.uss / 2**20))
    return SystemMemory(system, sorted(rows, key=lambda row: row.pss_mib, reverse=True))


def _load(url: str, model: str, args: argparse.Namespace, llama: bool = False) -> None:
    """Streamed chats, `args.concurrency` at a time (llama-server's connections closed after each, as `bench
    compare` loads it)."""
    chats = [[{"role": "user", "content": f"Tell me about topic number {index}, in detail."}] for index in range(args.requests)]
    asyncio.run(stream_requests(url, model, chats, args.concurrency, args.max_tokens, api="chat", close_connections=llama))


def _print(memory: SystemMemory) -> None:
    print(f"\n{memory.system}: RSS {memory.rss_mib:.0f} MiB summed over {len(memory.processes)} processes, "
          f"PSS {memory.pss_mib:.0f} MiB")
    print(f"{'RSS MiB':>9} {'PSS MiB':>9} {'own MiB':>9}  process")
    for row in memory.processes:
        if row.pss_mib >= 1:
            print(f"{row.rss_mib:9.0f} {row.pss_mib:9.0f} {row.uss_mib:9.0f}  {row.role} ({row.pid})")


def main(args: argparse.Namespace) -> None:
    measured: list[SystemMemory] = []
    with tempfile.TemporaryDirectory(prefix="serve-app-bench-") as workdir:
        server = ServeRun(Path(workdir), engine_kwargs=engine_form(args), timeout=1800, model=args.model)
        try:
            _load(server.url, server.model_id, args)
            measured.append(measure("serve run", server.process.pid))
        finally:
            server.stop()
        for gguf in map(Path, args.gguf):
            llama = LlamaServer(Path(args.llama_server), gguf, Path(workdir))
            try:
                _load(llama.url, served_id(args.model), args, llama=True)
                measured.append(measure(f"llama-server:{gguf.stem}", llama.process.pid))
            finally:
                llama.stop()
    for memory in measured:
        _print(memory)
    if len(measured) > 1:
        ours = measured[0]
        for peer in measured[1:]:
            print(f"serve run / {peer.system}: PSS {ours.pss_mib / peer.pss_mib:.2f}x, RSS {ours.rss_mib / peer.rss_mib:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{"system": m.system, "rss_mib": m.rss_mib, "pss_mib": m.pss_mib, "processes": [asdict(p) for p in m.processes]}
             for m in measured], indent=2))
