"""`serve-app bench process-cpu`: what streaming clients' tokens cost each process of a fresh
`serve run`: CPU time and context switches per generated token, process by process (the engine's
own, the replicas, Serve's and Ray's daemons, HAProxy), and the load generator's own; one client by
default, or each of `--concurrency`'s comma list in turn.

On a machine with few cores every other process's CPU comes out of the model's threads' time, so
this is where one client's speed over HTTP goes beside the step itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from serve_app.bench.engine_bench import engine_form
from serve_app.bench.servers import ServeRun
from serve_app.bench.stats import percentile
from serve_app.bench.systems import stream_requests



@dataclass(frozen=True)
class Sample:
    """A process's CPU time (user + system, seconds) and context switches so far."""

    role: str
    cpu_s: float
    switches: int


@dataclass(frozen=True)
class ProcessCost:
    """What a process spent per generated token over a measured run."""

    role: str
    pid: int
    cpu_ms_per_token: float
    switches_per_token: float


def role_of(cmdline: list[str], name: str) -> str:
    """A short name for a process from its command line: Ray's worker titles, the dashboard's heads,
    Ray's binaries and scripts, the engine's own process."""
    text = " ".join(cmdline) or name
    if "serve_app.engine.child" in text or "deployments.engine_child" in text:  # in process, or a replica's
        return "engine process"
    if match := re.match(r"ray::(\S+)", text):
        return match.group(1).removeprefix("ServeReplica:")
    if match := re.match(r"ray-dashboard-(\S+?)-\d+", text):
        return f"dashboard {match.group(1)}"
    if any(Path(part).name == "serve" and after == "run" for part, after in zip(cmdline, cmdline[1:])):
        return "serve run"
    for part in cmdline:
        stem = Path(part).name
        if stem.endswith(".py") or stem in ("gcs_server", "raylet", "haproxy"):
            return stem
    return Path(cmdline[0]).name if cmdline else name


def sample(processes: list[psutil.Process]) -> dict[int, Sample]:
    """Each live process's role, CPU time and context switches now."""
    samples = {}
    for process in processes:
        try:
            with process.oneshot():
                times, switches = process.cpu_times(), process.num_ctx_switches()
                role = "load generator" if process.pid == os.getpid() else role_of(process.cmdline(), process.name())
                samples[process.pid] = Sample(
                    role, times.user + times.system,
                    switches.voluntary + switches.involuntary,
                )
        except psutil.Error:  # gone in the meantime
            continue
    return samples


def costs(before: dict[int, Sample], after: dict[int, Sample], tokens: int) -> list[ProcessCost]:
    """Per-token CPU and switches of every process sampled at both ends, the costliest first."""
    rows = [
        ProcessCost(
            sample.role, pid, (sample.cpu_s - before[pid].cpu_s) / tokens * 1e3,
            (sample.switches - before[pid].switches) / tokens,
        )
        for pid, sample in after.items()
        if pid in before
    ]
    return sorted(rows, key=lambda row: row.cpu_ms_per_token, reverse=True)


def _processes(server: ServeRun) -> list[psutil.Process]:
    root = psutil.Process(server.process.pid)
    return [root, *root.children(recursive=True), psutil.Process()]  # the load generator last


def _clients(url: str, model: str, requests: int, max_tokens: int, concurrency: int = 1) -> tuple[int, list[float]]:
    """`requests` streams, `concurrency` at a time: tokens generated, and the gaps between each stream's
    chunks as its client saw them."""
    prompts = [f"Tell me about topic number {index}." for index in range(requests)]
    _, timings = asyncio.run(stream_requests(url, model, prompts, concurrency, max_tokens))
    return sum(t.output_tokens for t in timings), [gap for t in timings for gap in t.chunk_gaps]


def _measure(server: ServeRun, processes: list[psutil.Process], args: argparse.Namespace, concurrency: int) -> dict:
    """`args.requests` streams, `concurrency` at a time: each process's CPU per token, and the stream gaps."""
    before = sample(processes)
    start = time.perf_counter()
    tokens, gaps = _clients(server.url, server.model_id, args.requests, args.max_tokens, concurrency)
    wall = time.perf_counter() - start
    rows = costs(before, sample(processes), tokens)
    others = sum(row.cpu_ms_per_token for row in rows if row.role != "engine process")
    itl = {"itl_p50_ms": percentile(gaps, 50) * 1e3, "itl_p99_ms": percentile(gaps, 99) * 1e3, "chunks": len(gaps) + args.requests}
    print(f"concurrency {concurrency}: {tokens} tokens in {wall:.1f} s: {tokens / wall:.1f} tok/s, "
          f"{wall / tokens * 1e3:.1f} ms a token; {itl['chunks']} stream chunks, gaps between them "
          f"p50 {itl['itl_p50_ms']:.1f} ms, p99 {itl['itl_p99_ms']:.1f} ms")
    print(f"{'CPU ms/token':>12} {'switches/token':>14}  process")
    for row in rows:
        if row.cpu_ms_per_token >= 0.05:
            print(f"{row.cpu_ms_per_token:12.2f} {row.switches_per_token:14.1f}  {row.role} ({row.pid})")
    print(f"every process but the engine's: {others:.1f} ms of CPU a token")
    return {"concurrency": concurrency, "tokens": tokens, "wall_s": wall, "others_cpu_ms_per_token": others, **itl,
            "processes": [asdict(r) for r in rows]}


def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="serve-app-bench-") as workdir:
        server = ServeRun(Path(workdir), engine_kwargs=engine_form(args), timeout=1800, model=args.model)
        try:
            _clients(server.url, server.model_id, 1, 8)  # warm
            processes = _processes(server)
            runs = [_measure(server, processes, args, concurrency) for concurrency in args.concurrency]
        finally:
            server.stop()
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs}, indent=2))
