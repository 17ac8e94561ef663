"""`serve-app bench batch`: offline batches beside online serving, on this host, in one run.

1. Online: the app (`serve-app serve`, the shipped config on `--model`) under 64 and 128 streaming chat clients
   (the standard prompts, `--max-tokens` each, EOS ignored): its best output throughput. Each load and each TTFT
   series below asks prompts of its own, none of the batch's, so that none is answered from another's cached prefix.
2. The Batch API: one online client's TTFT, alone, then with a Batch-API batch of the batch's prompts running (its
   throughput meanwhile read from the batch's usage); the batch is cancelled after.
3. `serve-app batch` on `--prompts` prompts, the app stopped (the host's CPUs are the batch's), on a Ray cluster
   of its own: its output throughput over the whole run (start included) and from its first request to its end.

It reports batch / best online throughput (target >= 1.0) and the online TTFT p50 / p99 with the batch over
without (target p99 <= 1.5)."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from serve_app.bench.client import CompletionClient
from serve_app.bench.prompts import make_prompts
from serve_app.bench.servers import ServeRun, users_environment
from serve_app.bench.stats import BenchRow, dict_table, format_table, percentile


def messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


async def online(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> BenchRow:
    """`concurrency` clients streaming a chat of each prompt."""
    timings = []
    issued = 0

    async def client_loop(client: CompletionClient) -> None:
        nonlocal issued
        while issued < len(prompts):
            prompt = prompts[issued]
            issued += 1
            timings.append(await client.stream(model, messages(prompt), max_tokens))

    async with CompletionClient(url, api="chat") as client:
        begin = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        return BenchRow.from_timings(f"online c={concurrency}", concurrency, time.perf_counter() - begin, timings)


async def one_client_ttfts(url: str, model: str, prompts: list[str], max_tokens: int) -> list[float]:
    async with CompletionClient(url, api="chat") as client:
        return [(await client.stream(model, messages(prompt), max_tokens)).ttft for prompt in prompts]


def batch_file(model: str, prompts: list[str], max_tokens: int) -> str:
    """OpenAI's batch file of the prompts, bodies as the online clients send them (unstreamed)."""
    lines = []
    for index, prompt in enumerate(prompts):
        body = {"model": model, "messages": messages(prompt), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        lines.append(json.dumps({"custom_id": f"p{index}", "method": "POST", "url": "/v1/chat/completions", "body": body}))
    return "\n".join(lines) + "\n"


def start_api_batch(url: str, text: str) -> str:
    """Upload the file and create its batch; the batch's id."""
    uploaded = httpx.post(f"{url}/v1/files", files={"file": ("bench.jsonl", io.BytesIO(text.encode()))},
                          data={"purpose": "batch"}, timeout=120)
    uploaded.raise_for_status()
    created = httpx.post(f"{url}/v1/batches", json={"input_file_id": uploaded.json()["id"],
                                                    "endpoint": "/v1/chat/completions", "completion_window": "24h"}, timeout=60)
    created.raise_for_status()
    return created.json()["id"]


def api_batch(url: str, batch_id: str) -> dict:
    answer = httpx.get(f"{url}/v1/batches/{batch_id}", timeout=60)
    answer.raise_for_status()
    return answer.json()


def wait_for_progress(url: str, batch_id: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while (batch := api_batch(url, batch_id))["request_counts"]["completed"] == 0:
        if batch["status"] not in ("validating", "in_progress") or time.monotonic() > deadline:
            raise RuntimeError(f"the Batch API's batch made no progress: {batch}")
        time.sleep(0.5)
    return batch


def cli_batch(config: Path, text: str, workdir: Path) -> dict[str, float]:
    """`serve-app batch` on `text` with `config`, on a Ray cluster of its own: its wall time and tokens."""
    source, results = workdir / "requests.jsonl", workdir / "results.jsonl"
    source.write_text(text)
    command = [str(Path(sys.executable).with_name("serve-app")), "batch", "-i", str(source), "-o", str(results),
               "--config", str(config), "--address", "local"]
    ray_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    begin = time.perf_counter()
    with open(workdir / "batch.log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT,
                              env={**users_environment(os.environ), "RAY_TMPDIR": ray_dir})
    seconds, ended = time.perf_counter() - begin, time.time()
    if done.returncode != 0:
        raise RuntimeError(f"serve-app batch failed: {(workdir / 'batch.log').read_text()[-3000:]}")
    bodies = [json.loads(line)["response"]["body"] for line in results.read_text().splitlines()]
    tokens = sum(body["usage"]["completion_tokens"] for body in bodies)
    answering = ended - min(body["created"] for body in bodies)  # from the first request in (whole seconds) to the end
    return {"lines": len(bodies), "tokens": tokens, "seconds": round(seconds, 1), "answering_seconds": round(answering),
            "tok_s": round(tokens / seconds, 1), "answering_tok_s": round(tokens / answering, 1)}


def main(args: argparse.Namespace) -> None:
    prompts = make_prompts(args.prompts, seed=args.seed)
    loads, ttfts = len(args.online_concurrency) * args.online_requests, args.ttft_requests
    online_prompts = make_prompts(loads + 2 * ttfts, seed=args.seed + 1)
    per_load = args.online_requests
    load_prompts = [online_prompts[i * per_load:(i + 1) * per_load] for i in range(len(args.online_concurrency))]
    alone_prompts, beside_prompts = online_prompts[loads:loads + ttfts], online_prompts[loads + ttfts:]
    workdir = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    report: dict = {"model": args.model, "prompts": args.prompts, "max_tokens": args.max_tokens, "cpus": os.cpu_count()}
    (workdir / "serve").mkdir()
    run = ServeRun(workdir / "serve", model=args.model, args={"batch_files_path": str(workdir / "batch-files")})
    try:
        model = run.model_id
        rows = [asyncio.run(online(run.url, model, load, c, args.max_tokens))
                for c, load in zip(args.online_concurrency, load_prompts)]
        print(format_table(rows), flush=True)
        best = max(rows, key=lambda row: row.output_tok_s)
        report["online"] = [row.as_dict() for row in rows]
        alone = asyncio.run(one_client_ttfts(run.url, model, alone_prompts, args.max_tokens))
        batch_id = start_api_batch(run.url, batch_file(model, prompts, args.max_tokens))
        before = wait_for_progress(run.url, batch_id)
        began = time.perf_counter()
        beside = asyncio.run(one_client_ttfts(run.url, model, beside_prompts, args.max_tokens))
        after = api_batch(run.url, batch_id)
        api_tok_s = (after["usage"]["output_tokens"] - before["usage"]["output_tokens"]) / (time.perf_counter() - began)
        httpx.post(f"{run.url}/v1/batches/{batch_id}/cancel", timeout=60)
    finally:
        run.stop()
    offline = cli_batch(run.config_path, batch_file(model, prompts, args.max_tokens), workdir)
    ttft = {
        "alone_p50_s": round(percentile(alone, 50), 4), "alone_p99_s": round(percentile(alone, 99), 4),
        "beside_batch_p50_s": round(percentile(beside, 50), 4), "beside_batch_p99_s": round(percentile(beside, 99), 4),
        "batch_api_tok_s_meanwhile": round(api_tok_s, 1),
    }
    ratios = {
        "batch_over_best_online": round(offline["tok_s"] / best.output_tok_s, 2),
        "batch_answering_over_best_online": round(offline["answering_tok_s"] / best.output_tok_s, 2),
        "ttft_p50_beside_over_alone": round(ttft["beside_batch_p50_s"] / ttft["alone_p50_s"], 2),
        "ttft_p99_beside_over_alone": round(ttft["beside_batch_p99_s"] / ttft["alone_p99_s"], 2),
    }
    report.update(best_online=best.system, serve_app_batch=offline, ttft=ttft, ratios=ratios,
                  ttfts_s={"alone": [round(t, 4) for t in alone], "beside_batch": [round(t, 4) for t in beside]})
    print(dict_table([{"what": "serve-app batch", **offline}]))
    print(dict_table([ttft]))
    print(dict_table([ratios]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
