"""`serve-app bench route`: the prefix-aware router against Serve's default on live engine replicas.

Three `serve run`s, one after another in one run, on the same workload: one engine replica that
holds the whole workload (every core, and a cache as big as the two replicas' together), then two
replicas (one torch thread each, as they share this machine's cores) routed by
`deployments.router:PrefixAwareRouter`, then the same two routed by Serve's default
power-of-two-choices router. The workload: tenants with
API keys of their own, each with a long system prompt, and multi-turn chat conversations spread
over them, arriving at `arrival_rate` per second, every turn sending the history so far (greedy, a
fixed number of new tokens, the next turn after a pause to read). Reported per system: prompt
tokens and those the prefix cache held, TTFT p50 and p99, output tok/s, requests per replica
(`/stats/replicas`), the router's own decision cost (`/stats/routing`) and the ingress replica's
memory; then the ratios the router is held to.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil

from serve_app.bench.prompts import WORDS
from serve_app.bench.servers import ServeRun
from serve_app.bench.stats import dict_table, percentile

ADMIN_KEY = "bench-route-admin"
DEFAULT_ROUTER = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"


@dataclass(frozen=True)
class ChatWorkload:
    tenants: int = 4
    conversations: int = 24
    turns: int = 4
    system_words: int = 300
    user_words: int = 120
    answer_tokens: int = 32
    arrival_rate: float = 0.25  # new conversations per second (Poisson)
    think_s: float = 2.0  # mean of the exponential pause between an answer and the next turn
    seed: int = 0

    def tenant_key(self, tenant: int) -> str:
        return f"bench-route-tenant-{tenant}"

    def keys_file(self, folder: Path) -> Path:
        """The API keys: one per tenant and an admin's (for the stats routes)."""
        keys = {self.tenant_key(t): {"tenant": f"tenant-{t}", "role": "user"} for t in range(self.tenants)}
        keys[ADMIN_KEY] = {"tenant": "bench-admin", "role": "admin"}
        path = folder / "keys.json"
        path.write_text(json.dumps(keys))
        return path

    def system_prompt(self, tenant: int) -> str:
        rng = random.Random(f"{self.seed}-system-{tenant}")
        rules = " ".join(rng.choice(WORDS) for _ in range(self.system_words))
        return f"You are the assistant of tenant {tenant}. Follow these house notes: {rules}."

    def user_turn(self, conversation: int, turn: int) -> str:
        rng = random.Random(f"{self.seed}-user-{conversation}-{turn}")
        notes = " ".join(rng.choice(WORDS) for _ in range(self.user_words))
        return f"Conversation {conversation}, turn {turn}. My notes: {notes}. What do they say?"

    def think(self, conversation: int, turn: int) -> float:
        return random.Random(f"{self.seed}-think-{conversation}-{turn}").expovariate(1.0 / self.think_s) if self.think_s else 0.0


@dataclass(frozen=True)
class TurnResult:
    ttft: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class System:
    name: str
    replicas: int
    threads: int
    router: str  # request_router_class

    def engine_options(self) -> dict[str, Any]:
        return {
            "autoscaling_config": {"min_replicas": self.replicas, "max_replicas": self.replicas},
            "ray_actor_options": {"num_cpus": 0},
            "request_router_config": {"request_router_class": self.router},
        }


REPLICAS = 2  # the routed systems'


def systems() -> list[System]:
    ours = "deployments.router:PrefixAwareRouter"
    return [
        System("one replica", 1, REPLICAS, ours),
        System("prefix-aware router", REPLICAS, 1, ours),
        System("Serve's default router", REPLICAS, 1, DEFAULT_ROUTER),
    ]


async def _chat_turn(session: aiohttp.ClientSession, url: str, key: str, body: dict[str, Any]) -> tuple[TurnResult, str]:
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    text: list[str] = []
    usage: dict[str, Any] = {}
    headers = {"Authorization": f"Bearer {key}"}
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream failed: {chunk['error']}")
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                produced = len((choice.get("logprobs") or {}).get("content") or [])
                if produced:  # one logprob per token: a first token with empty text counts too
                    first = first or time.perf_counter()
                    tokens += produced
                text.append(choice["delta"].get("content") or "")
    result = TurnResult(
        ttft=(first or start) - start,
        output_tokens=tokens,
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
    )
    return result, "".join(text)


async def _drive(url: str, model: str, workload: ChatWorkload) -> tuple[float, list[TurnResult]]:
    """Conversations arriving as a Poisson process (open loop, as users come), each turn after the previous
    answer and a pause to read it."""
    results: list[TurnResult] = []
    arrivals = random.Random(f"{workload.seed}-arrivals")

    async def converse(session: aiohttp.ClientSession, conversation: int) -> None:
        tenant = conversation % workload.tenants
        messages = [{"role": "system", "content": workload.system_prompt(tenant)}]
        for turn in range(workload.turns):
            if turn:
                await asyncio.sleep(workload.think(conversation, turn))  # the user reads, then types
            messages.append({"role": "user", "content": workload.user_turn(conversation, turn)})
            body = {
                "model": model, "messages": messages, "max_tokens": workload.answer_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True,
            }
            result, answer = await _chat_turn(session, url, workload.tenant_key(tenant), body)
            results.append(result)
            messages.append({"role": "assistant", "content": answer})

    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        begin = time.perf_counter()
        conversations = []
        for conversation in range(workload.conversations):
            conversations.append(asyncio.create_task(converse(session, conversation)))
            await asyncio.sleep(arrivals.expovariate(workload.arrival_rate))
        await asyncio.gather(*conversations)
        return time.perf_counter() - begin, results


def _admin_get(url: str, path: str) -> Any:
    response = httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    response.raise_for_status()
    return response.json()


def _tasks_per_replica(url: str) -> dict[str, int]:
    return {replica: stats["total_tasks"] for replica, stats in _admin_get(url, "/stats/replicas").items()}


def _wait_for_replicas(url: str, count: int, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(_tasks_per_replica(url)) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} engine replicas did not come up in {timeout_s} s")
        time.sleep(1.0)


def _ingress_rss_mb(run: ServeRun) -> float:
    """Resident memory of the ingress replica's process (it holds the tokenizer and chat template)."""
    for proc in psutil.Process(run.process.pid).children(recursive=True):
        try:
            if "ServeReplica:llm:Ingress" in " ".join(proc.cmdline()):
                return round(proc.memory_info().rss / 2**20, 1)
        except psutil.NoSuchProcess:
            continue
    return 0.0


def _routing_costs(url: str, decisions_at_least: int) -> dict[str, float]:
    """The routers' decision costs once their reports (every 2 s) cover the run's decisions."""
    deadline = time.monotonic() + 10
    while True:
        routers = _admin_get(url, "/stats/routing")
        if sum(r["decisions"] for r in routers.values()) >= decisions_at_least or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if not routers:
        return {}
    busiest = max(routers.values(), key=lambda r: r["decisions"])  # one ingress replica: its one router
    return {"decision p50 us": busiest.get("p50_us"), "decision p99 us": busiest.get("p99_us")}


def run_system(
    system: System, workload: ChatWorkload, engine_args: dict[str, Any], router_kwargs: dict[str, Any], folder: Path,
    model: str,
) -> dict[str, Any]:
    options = system.engine_options()
    if system.router != DEFAULT_ROUTER:
        options["request_router_config"]["request_router_kwargs"] = router_kwargs
    run = ServeRun(
        folder,
        engine_kwargs={
            **engine_args,
            "cache_tokens": engine_args["cache_tokens"] * REPLICAS // system.replicas,  # the same cache in all
            "num_threads": system.threads,
        },
        args={"api_keys_file": str(workload.keys_file(folder))},
        engine_deployment=options,
        timeout=600,
        model=model,
    )
    try:
        _wait_for_replicas(run.url, system.replicas)
        before = _tasks_per_replica(run.url)
        duration, results = asyncio.run(_drive(run.url, run.model_id, workload))
        after = _tasks_per_replica(run.url)
        per_replica = sorted(after[r] - before.get(r, 0) for r in after)
        ingress_mb = _ingress_rss_mb(run)
        costs = _routing_costs(run.url, len(results)) if system.router != DEFAULT_ROUTER else {}
    finally:
        run.stop()
    ttfts = [r.ttft for r in results]
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    return {
        "system": system.name,
        "replicas": system.replicas,
        "requests": len(results),
        "prompt tokens": prompt,
        "cached tokens": cached,
        "cached share": round(cached / max(1, prompt), 3),
        "ttft p50 s": round(percentile(ttfts, 50), 3),
        "ttft p99 s": round(percentile(ttfts, 99), 3),
        "output tok/s": round(sum(r.output_tokens for r in results) / duration, 1),
        "requests per replica": per_replica,
        "ingress RSS MB": ingress_mb,
        "decision p50 us": costs.get("decision p50 us"),
        "decision p99 us": costs.get("decision p99 us"),
    }


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    one, ours, default = rows
    return {
        "hit tokens, prefix-aware / one replica (>= 0.9)": round(ours["cached tokens"] / max(1, one["cached tokens"]), 3),
        "TTFT p50, prefix-aware / default router (<= 0.5)": round(ours["ttft p50 s"] / default["ttft p50 s"], 3),
        "requests, busiest / idlest replica, prefix-aware (<= 1.5)": round(
            max(ours["requests per replica"]) / max(1, min(ours["requests per replica"])), 2
        ),
    }


def main(args: argparse.Namespace) -> None:
    workload = ChatWorkload(
        tenants=args.tenants or 4, conversations=args.conversations, turns=args.turns, system_words=args.system_words,
        user_words=args.user_words, answer_tokens=args.max_tokens, arrival_rate=args.rate, think_s=args.think_s,
        seed=args.seed,
    )
    engine_args = {"cache_tokens": args.cache_tokens, "max_model_len": args.max_model_len}
    router_kwargs = {
        "balance_abs_threshold": args.balance_abs_threshold, "balance_rel_threshold": args.balance_rel_threshold,
        "min_match_ratio": args.min_match_ratio,
    }
    rows = []
    for system in systems():
        with tempfile.TemporaryDirectory(prefix="bench-route-") as folder:
            print(f"running {system.name} ...", flush=True)
            rows.append(run_system(system, workload, engine_args, router_kwargs, Path(folder), args.model))
    print(dict_table(rows))
    summary = ratios(rows)
    for name, value in summary.items():
        print(f"{name}: {value}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": rows, "ratios": summary}, out, indent=2)
