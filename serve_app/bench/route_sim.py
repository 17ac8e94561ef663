"""`serve-app bench route --simulate`: the request router's own code (`PrefixRouting`, the page
hashing, the directory and the index) against N simulated replicas, past what this machine runs.

No model: each replica is an LRU cache of `cache_pages` pages and a service time per token (prefill
of what its cache misses, and decode) from the measured engine. The trace is many tenants, each with
a long system prompt shared by its conversations, and multi-turn conversations whose next turn
comes after the previous answer. Replicas report the pages they cache and evict to a
`PageDirectory`, which the router follows `event_delay_s` late, as in Serve. Reported per N: the
prompt tokens found cached as a share of what one unbounded cache would find, the most and fewest
requests per replica, and the wall-clock cost of one routing decision; against Serve's
power-of-two-choices router on the same trace.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from serve_app.bench.stats import dict_table
from serve_app.kv.prefix_cache import page_hashes
from serve_app.routing.costs import DecisionCosts
from serve_app.routing.decision import PrefixRouting
from serve_app.routing.page_directory import PageDirectory
from serve_app.routing.policy import RoutingPolicy
from serve_app.wire.page_events import PageEventBatch, PageHash


@dataclass(frozen=True)
class Workload:
    tenants: int = 16
    conversations: int = 256
    turns: int = 4
    system_tokens: int = 512
    user_tokens: int = 48
    answer_tokens: int = 64
    arrival_rate: float = 8.0  # new conversations per simulated second
    think_s: float = 2.0  # between an answer and the next turn
    seed: int = 0


@dataclass(frozen=True)
class ReplicaModel:
    cache_pages: int = 2048
    page_size: int = 16
    prefill_s_per_token: float = 0.0005
    decode_s_per_token: float = 0.02
    event_delay_s: float = 0.2  # engine -> board -> router


@dataclass(frozen=True)
class Turn:
    tenant: int
    conversation: int
    index: int
    prompt: tuple[int, ...]


class SimReplica:
    """A page cache (LRU) and the requests in flight; it reports what it caches and evicts."""

    def __init__(self, name: str, model: ReplicaModel) -> None:
        self.name = name
        self.model = model
        self.cache: OrderedDict[PageHash, None] = OrderedDict()
        self.in_flight = 0
        self.requests = 0
        self._stored: set[PageHash] = set()
        self._removed: set[PageHash] = set()

    def cached_prefix(self, hashes: Sequence[PageHash]) -> int:
        count = 0
        for page_hash in hashes:
            if page_hash not in self.cache:
                break
            count += 1
        return count

    def cache_pages(self, hashes: Sequence[PageHash]) -> None:
        for page_hash in hashes:
            if page_hash in self.cache:
                self.cache.move_to_end(page_hash)
                continue
            self.cache[page_hash] = None
            self._removed.discard(page_hash)
            self._stored.add(page_hash)
            while len(self.cache) > self.model.cache_pages:
                evicted, _ = self.cache.popitem(last=False)
                self._stored.discard(evicted)
                self._removed.add(evicted)

    def take_events(self) -> PageEventBatch:
        batch = PageEventBatch(frozenset(self._stored), frozenset(self._removed))
        self._stored, self._removed = set(), set()
        return batch


@dataclass
class Result:
    router: str
    replicas: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    ideal_cached_tokens: int
    per_replica: list[int]
    decisions: DecisionCosts = field(default_factory=lambda: DecisionCosts(keep=1 << 20))

    def row(self) -> dict[str, object]:
        costs = self.decisions.summary()
        return {
            "router": self.router,
            "replicas": self.replicas,
            "requests": self.requests,
            "hit ratio vs one cache": round(self.cached_tokens / max(1, self.ideal_cached_tokens), 3),
            "max/min requests": round(max(self.per_replica) / max(1, min(self.per_replica)), 2),
            "decision p50 us": costs.get("p50_us"),
            "decision p99 us": costs.get("p99_us"),
        }


def _tokens(rng: random.Random, count: int) -> tuple[int, ...]:
    return tuple(rng.randrange(5, 49000) for _ in range(count))


def _first_turns(workload: Workload) -> tuple[list[tuple[float, Turn]], dict[int, tuple[int, ...]], random.Random]:
    rng = random.Random(workload.seed)
    systems = {tenant: _tokens(rng, workload.system_tokens) for tenant in range(workload.tenants)}
    arrivals, now = [], 0.0
    for conversation in range(workload.conversations):
        now += rng.expovariate(workload.arrival_rate)
        tenant = rng.randrange(workload.tenants)
        prompt = systems[tenant] + _tokens(rng, workload.user_tokens)
        arrivals.append((now, Turn(tenant, conversation, 0, prompt)))
    return arrivals, systems, rng


def simulate(router: str, replicas: int, workload: Workload, model: ReplicaModel, policy: RoutingPolicy) -> Result:
    """Run the trace through `router` ('prefix': ours; 'pow2': Serve's default) on `replicas` replicas."""
    first, _, rng = _first_turns(workload)
    choice_rng = random.Random(workload.seed + 1)
    fleet = [SimReplica(f"r{i}", model) for i in range(replicas)]
    by_name = {replica.name: replica for replica in fleet}
    directory = PageDirectory()
    routing = PrefixRouting(policy)
    for replica in fleet:
        directory.publish(replica.name, PageEventBatch(snapshot=frozenset()), model.page_size)
    routing.index.apply(directory.changes(0))
    ideal: set[PageHash] = set()  # one cache that never evicts
    result = Result(router, replicas, 0, 0, 0, 0, [0] * replicas)
    # (time, order, kind, payload): arrivals, finishes and the router catching up with the directory.
    events: list[tuple[float, int, str, object]] = []
    order = 0

    def push(at: float, kind: str, payload: object) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (at, order, kind, payload))

    for at, turn in first:
        push(at, "arrive", turn)
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "publish":
            name, batch = payload  # type: ignore[misc]
            directory.publish(name, batch, model.page_size)
            routing.index.apply(directory.changes(routing.index.seq))
            continue
        if kind == "finish":
            replica, turn, answer = payload  # type: ignore[misc]
            replica.in_flight -= 1
            whole = turn.prompt + answer
            whole_hashes = list(page_hashes(whole, model.page_size, f"tenant-{turn.tenant}"))
            replica.cache_pages(whole_hashes)
            ideal.update(whole_hashes)
            push(now + model.event_delay_s, "publish", (replica.name, replica.take_events()))
            if turn.index + 1 < workload.turns:
                following = Turn(turn.tenant, turn.conversation, turn.index + 1, whole + _tokens(rng, workload.user_tokens))
                push(now + workload.think_s, "arrive", following)
            continue
        turn: Turn = payload  # type: ignore[no-redef]
        salt = f"tenant-{turn.tenant}"
        loads = {replica.name: replica.in_flight for replica in fleet}
        started = time.perf_counter()
        if router == "prefix":
            hashes = routing.hashes(turn.prompt, salt)
            group = routing.rank(hashes, by_name, loads)[0]
            chosen = by_name[min(group, key=lambda name: loads[name])]
            routing.routed(chosen.name, hashes)
        else:
            hashes = list(page_hashes(turn.prompt, model.page_size, salt))
            pair = choice_rng.sample(fleet, min(2, len(fleet)))
            chosen = min(pair, key=lambda replica: replica.in_flight)
        result.decisions.add(time.perf_counter() - started)
        hit = chosen.cached_prefix(hashes)
        ideal_hit = 0
        for page_hash in hashes:
            if page_hash not in ideal:
                break
            ideal_hit += 1
        ideal.update(hashes)
        chosen.cache_pages(hashes)
        push(now + model.event_delay_s, "publish", (chosen.name, chosen.take_events()))
        chosen.in_flight += 1
        chosen.requests += 1
        result.requests += 1
        result.prompt_tokens += len(turn.prompt)
        result.cached_tokens += hit * model.page_size
        result.ideal_cached_tokens += ideal_hit * model.page_size
        answer = _tokens(rng, workload.answer_tokens)
        service = (len(turn.prompt) - hit * model.page_size) * model.prefill_s_per_token + len(answer) * model.decode_s_per_token
        push(now + service, "finish", (chosen, turn, answer))
    result.per_replica = [replica.requests for replica in fleet]
    return result


def main(args: argparse.Namespace) -> None:
    policy = RoutingPolicy(args.balance_abs_threshold, args.balance_rel_threshold, args.min_match_ratio)
    model = ReplicaModel(cache_pages=args.cache_pages, page_size=args.page_size)
    rows = []
    for replicas in args.replicas:
        workload = Workload(
            tenants=args.tenants or 16, conversations=args.conversations_per_replica * replicas, turns=args.turns,
            arrival_rate=args.arrival_rate_per_replica * replicas, seed=args.seed,
        )
        for router in ("prefix", "pow2"):
            rows.append(simulate(router, replicas, workload, model, policy).row())
    print(dict_table(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)

