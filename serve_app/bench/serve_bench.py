"""`serve-app bench serve --url URL`: load a running server by concurrency sweep or Poisson request rate.

Both modes stop by themselves: after `--requests` requests or `--duration` seconds, whichever
comes first, then wait for the requests in flight.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict

import httpx

from serve_app.bench.client import CompletionClient
from serve_app.bench.prompts import make_prompts
from serve_app.bench.stats import BenchRow, RequestTiming, format_table


async def _by_concurrency(url: str, model: str, prompts: list[str], concurrency: int, requests: int, duration: float, max_tokens: int):
    timings: list[RequestTiming] = []
    deadline = time.perf_counter() + duration
    issued = 0

    async def worker() -> None:
        nonlocal issued
        while issued < requests and time.perf_counter() < deadline:
            prompt = prompts[issued % len(prompts)]
            issued += 1
            timings.append(await client.stream(model, prompt, max_tokens))

    async with CompletionClient(url) as client:
        begin = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - begin, timings


async def _by_rate(url: str, model: str, prompts: list[str], rate: float, requests: int, duration: float, max_tokens: int, seed: int):
    rng = random.Random(seed)
    tasks = []
    async with CompletionClient(url) as client:
        begin = time.perf_counter()
        deadline = begin + duration
        while len(tasks) < requests and time.perf_counter() < deadline:
            prompt = prompts[len(tasks) % len(prompts)]
            tasks.append(asyncio.create_task(client.stream(model, prompt, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        timings = await asyncio.gather(*tasks)
        return time.perf_counter() - begin, list(timings)


def main(args) -> None:
    model = args.model or httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
    prompts = make_prompts(max(args.requests, 1), seed=args.seed)
    rows = []
    if args.rate:
        duration, timings = asyncio.run(
            _by_rate(args.url, model, prompts, args.rate, args.requests, args.duration, args.max_tokens, args.seed)
        )
        rows.append(BenchRow.from_timings(f"serve@{args.rate}rps", 0, duration, timings))
    else:
        for concurrency in args.concurrency:
            duration, timings = asyncio.run(
                _by_concurrency(args.url, model, prompts, concurrency, args.requests, args.duration, args.max_tokens)
            )
            rows.append(BenchRow.from_timings("serve", concurrency, duration, timings))
    print(format_table(rows))
    for row in rows:
        print(json.dumps(asdict(row)))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([asdict(row) for row in rows], handle, indent=2)
