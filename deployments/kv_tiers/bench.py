"""`serve-app bench tiers`: time to first token of a long shared prefix recomputed against served from each
KV tier, and multi-turn conversations whose history overflows the pool, tiers on against tiers off.

It starts a Ray cluster of two raylets on this host (`ray.cluster_utils.Cluster`, as Ray's own tests do),
each with a node page store of its own. An engine "on the first node" computes each document (recompute),
then asks again while its pages are in its pool (pool). A fresh engine on that node reads them from the
node's store (host: as a restarted replica would), one with the disk tier only from the page files
(disk), and one "on the second node" from the first node's store through Ray's object manager (cluster).
Every engine runs in this process, told its node by `kv_tiers.node_id` and handed the Ray tiers.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from deployments.kv_tiers.ray_stores import ray_tiers
from serve_app.bench.idle import wait_idle
from serve_app.bench.prompts import long_passage
from serve_app.bench.stats import dict_table, percentile
from serve_app.engine.engine import InferenceEngine
from serve_app.wire.requests import GenerateRequest

QUESTIONS = ["Summarise the passage.", "What is its main word?", "Give it a title.", "Who would read it?",
             "Name one detail.", "What comes next?"]


def _timed(engine: InferenceEngine, request: GenerateRequest) -> tuple[float, int, list[int]]:
    """Seconds to the first token, cached prompt tokens, and the tokens, once the engine is idle again."""
    start = time.perf_counter()
    first: list[float] = []
    result = engine.submit(request, lambda delta: first.append(time.perf_counter()) if delta.token_ids and not first else None).wait()
    wait_idle(engine.get_stats, timeout=300)  # every page written down before the next measurement
    return first[0] - start, result.usage.cached_tokens, list(result.token_ids)


def _ask(document: str, question: str, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(messages=[{"role": "system", "content": document}, {"role": "user", "content": question}],
                           max_tokens=max_tokens, temperature=0, ignore_eos=True)


@contextmanager
def _engine(model: str, cache_tokens: int, **tiers: object) -> Iterator[InferenceEngine]:
    engine = InferenceEngine(model=model, cache_tokens=cache_tokens, max_model_len=8192, kv_tiers=tiers, ray_tiers=ray_tiers)
    try:
        yield engine
    finally:
        engine.shutdown()


def prefix_cases(model: str, nodes: tuple[str, str], disk: Path, documents: int, prefix_tokens: int,
                 max_tokens: int) -> list[dict[str, object]]:
    """TTFT p50 of each document's question by where its prefix came from."""
    first, second = nodes
    host = {"host_bytes": 4 * 2**30, "node_id": first}
    runs: dict[str, list[tuple[float, int, list[int]]]] = {}
    cache_tokens = documents * (prefix_tokens + 256) + 1024
    with _engine(model, cache_tokens, **host, disk_path=str(disk)) as engine:
        rng = random.Random(0)
        texts = [long_passage(engine.tokenizer, prefix_tokens, rng) for _ in range(documents)]
        for case in ("recompute", "pool"):
            runs[case] = [_timed(engine, _ask(text, QUESTIONS[i % len(QUESTIONS)], max_tokens)) for i, text in enumerate(texts)]
    readers = {"host": host, "disk": {"disk_path": str(disk)},
               "cluster": {"cluster": True, "host_bytes": 4 * 2**30, "node_id": second}}
    for case, tiers in readers.items():
        with _engine(model, cache_tokens, **tiers) as engine:
            runs[case] = [_timed(engine, _ask(text, QUESTIONS[i % len(QUESTIONS)], max_tokens)) for i, text in enumerate(texts)]
    recompute = percentile([ttft for ttft, _, _ in runs["recompute"]], 50)
    rows = []
    for case, timed in runs.items():
        ttft = percentile([t for t, _, _ in timed], 50)
        rows.append({"case": case, "ttft_p50_s": round(ttft, 3), "vs_recompute": round(ttft / recompute, 3),
                     "cached_tokens_p50": int(percentile([hit for _, hit, _ in timed], 50)),
                     "same_tokens": [tokens for _, _, tokens in timed] == [tokens for _, _, tokens in runs["recompute"]]})
    return rows


def conversation_cases(model: str, node: str, conversations: int, turns: int, system_tokens: int, pool_tokens: int,
                       max_tokens: int) -> list[dict[str, object]]:
    """Round-robin multi-turn conversations whose histories together overflow the pool: TTFT p50 of every
    turn after the first, tiers off against the host tier on."""
    rows = []
    for label, tiers in (("tiers off", {}), ("tiers on (host)", {"host_bytes": 4 * 2**30, "node_id": node})):
        with _engine(model, pool_tokens, **tiers) as engine:
            rng = random.Random(1)
            histories = [[{"role": "system", "content": long_passage(engine.tokenizer, system_tokens, rng)}]
                         for _ in range(conversations)]
            later: list[float] = []
            cached: list[int] = []
            for turn in range(turns):
                for index, history in enumerate(histories):
                    history.append({"role": "user", "content": f"{QUESTIONS[(index + turn) % len(QUESTIONS)]} ({turn})"})
                    request = GenerateRequest(messages=history, max_tokens=max_tokens, temperature=0, ignore_eos=True)
                    ttft, hit, tokens = _timed(engine, request)
                    history.append({"role": "assistant", "content": engine.tokenizer.decode(tokens)})
                    if turn:
                        later.append(ttft)
                        cached.append(hit)
            rows.append({"case": label, "ttft_p50_s": round(percentile(later, 50), 3),
                         "cached_tokens_p50": int(percentile(cached, 50)), "turns": len(later)})
    off = rows[0]["ttft_p50_s"]
    for row in rows:
        row["vs_tiers_off"] = round(row["ttft_p50_s"] / off, 3)  # type: ignore[operator]
    return rows


def main(args) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 6 * 2**30})
    second = cluster.add_node(num_cpus=1, object_store_memory=6 * 2**30)
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    try:
        nodes = (cluster.head_node.node_id, second.node_id)
        with tempfile.TemporaryDirectory(prefix="kv-disk-") as disk:
            prefixes = prefix_cases(args.model, nodes, Path(disk), args.documents, args.prefix_tokens, args.max_tokens)
        print(f"{args.prefix_tokens}-token shared prefixes, {args.documents} documents:")
        print(dict_table(prefixes))
        talks = conversation_cases(args.model, nodes[0], args.conversations, args.turns, args.system_tokens,
                                   args.pool_tokens, args.max_tokens)
        print(f"\n{args.conversations} conversations x {args.turns} turns, {args.system_tokens}-token system prompts, "
              f"a pool of {args.pool_tokens} tokens:")
        print(dict_table(talks))
    finally:
        ray.shutdown()
        cluster.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps({"prefixes": prefixes, "conversations": talks}, indent=2))
