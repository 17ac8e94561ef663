"""`serve-app bench soak`: many streaming clients against a fresh `serve run`, round after round.

A third of the clients hang up after a few chunks and a tenth send malformed requests; the
rest stream to the end. Every request must complete, or get a 4xx in the protocol's error
shape, within a deadline (else it counts as a hang). After each round the server must be idle
with every KV page back, and its memory must not grow from round to round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from serve_app.bench.idle import http_stats, wait_idle
from serve_app.bench.prompts import make_prompts
from serve_app.bench.servers import ServeRun

MALFORMED: list[bytes] = [
    b'{"model": "smollm2-135m-instruct", "messages": [',
    b'{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": "many"}',
    b'{"model": "no-such-model", "messages": [{"role": "user", "content": "Hi"}]}',
    b'{"model": "smollm2-135m-instruct", "messages": [{"role": "robot", "content": "Hi"}]}',
    b"\xff\xfe not json",
    b"[1, 2, 3]",
]


@dataclass
class RoundReport:
    round: int
    outcomes: dict[str, int]
    idle_after_s: float
    pages_back: bool
    rss_mb: float
    problems: list[str] = field(default_factory=list)


async def _stream(
    session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int, hang_up_after: int | None
) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True}
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        if response.status != 200:
            return f"status {response.status}"
        chunks = 0
        async for line in response.content:
            if line.startswith(b"data: [DONE]"):
                return "completed"
            if line.startswith(b"data: {"):
                if b'"error"' in line[:20]:
                    return "stream error"
                chunks += 1
                if hang_up_after is not None and chunks >= hang_up_after:
                    return "hung up"
        return "stream cut"


async def _malformed(session: aiohttp.ClientSession, url: str, body: bytes) -> str:
    async with session.post(f"{url}/v1/chat/completions", data=body, headers={"content-type": "application/json"}) as response:
        data = await response.json(content_type=None)
        shaped = isinstance(data, dict) and isinstance(data.get("error"), dict) and "message" in data["error"]
        return "refused" if 400 <= response.status < 500 and shaped else f"bad refusal {response.status}"


async def _round(url: str, model: str, clients: int, duration: float, max_tokens: int, deadline_s: float) -> Counter:
    prompts = make_prompts(64, seed=1, long_every=0)
    outcomes: Counter = Counter()
    end = time.monotonic() + duration
    timeout = aiohttp.ClientTimeout(total=deadline_s)

    async def client(index: int) -> None:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            turn = 0
            while time.monotonic() < end:
                turn += 1
                try:
                    if index % 10 == 9:
                        outcome = await _malformed(session, url, MALFORMED[turn % len(MALFORMED)])
                        await asyncio.sleep(0.05)
                    else:
                        hang_up = 3 if index % 3 == 0 else None
                        outcome = await _stream(session, url, model, prompts[(index + turn) % len(prompts)], max_tokens, hang_up)
                except asyncio.TimeoutError:
                    outcome = "hang"
                except aiohttp.ClientError as error:
                    outcome = f"client error {type(error).__name__}"
                outcomes[outcome] += 1

    await asyncio.gather(*(client(i) for i in range(clients)))
    return outcomes


def _wait_idle(url: str, timeout: float) -> tuple[float, bool]:
    """How long the server took to be idle with every page back, and whether it was within `timeout`."""
    start = time.monotonic()
    try:
        wait_idle(http_stats(url), timeout, interval=0.2)
        return time.monotonic() - start, True
    except TimeoutError:
        return time.monotonic() - start, False


def run_soak(
    server: ServeRun, clients: int, duration: float, rounds: int, max_tokens: int, deadline_s: float
) -> list[RoundReport]:
    """`rounds` rounds of `clients` misbehaving clients against `server`, each followed by a wait for it to be idle."""
    reports: list[RoundReport] = []
    for number in range(1, rounds + 1):
        outcomes = asyncio.run(_round(server.url, server.model_id, clients, duration, max_tokens, deadline_s))
        idle_s, back = _wait_idle(server.url, timeout=60)
        report = RoundReport(number, dict(outcomes), round(idle_s, 2), back, round(server.rss_mb(), 1))
        allowed = {"completed", "hung up", "refused"}
        report.problems = [f"{count} x {name}" for name, count in outcomes.items() if name not in allowed]
        if not back:
            report.problems.append("not idle with every KV page back within 60 s")
        reports.append(report)
        print(f"round {number}: {dict(outcomes)}; idle after {idle_s:.1f} s; pages back: {back}; "
              f"rss {report.rss_mb:.0f} MB", flush=True)
    return reports


def memory_growth_mb(reports: list[RoundReport]) -> float:
    """RSS growth from the second round (the first warms up) to the last."""
    return reports[-1].rss_mb - reports[min(1, len(reports) - 1)].rss_mb


def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = ServeRun(Path(tmp), engine_kwargs={"cache_tokens": 8192, "max_model_len": 2048}, model=args.model)
        try:
            reports = run_soak(server, args.concurrency, args.duration, args.rounds, args.max_tokens, args.deadline)
        finally:
            server.stop()
    growth = memory_growth_mb(reports)
    problems = [f"round {r.round}: {p}" for r in reports for p in r.problems]
    if growth > args.max_growth_mb:
        problems.append(f"memory grew {growth:.0f} MB from round 2 to round {len(reports)}")
    print(f"memory growth after warm-up: {growth:.0f} MB; problems: {problems or 'none'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": [asdict(r) for r in reports], "problems": problems}, indent=2))
    if problems:
        raise SystemExit(1)
