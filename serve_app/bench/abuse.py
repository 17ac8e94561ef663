"""`serve-app bench abuse`: does a tenant that sends costly or malformed requests hurt another?

On a fresh `serve run` with two API keys, a victim streams short chats at a steady rate while an attacker
sends one shape of request in a loop, shape after shape. Per shape it reports the attacker's statuses and
answer times, and the victim's TTFT and inter-token p50/p99 against its own baseline (the victim alone,
first, in the same run). The target: every attacker request answered (4xx, or a bounded 200) within
`--answer-deadline` seconds, the victim loses no request, and its TTFT p99 stays within `--max-ttft-ratio`
of its baseline. Afterwards the server must be idle with every KV page back. Each attacker client sends
`--attacker-rate` requests a second (a busy client); 0 sends each as soon as the last is answered, a flood
whose cost is its rate, whatever its shape.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from serve_app.bench.idle import is_idle
from serve_app.bench.prompts import make_prompts
from serve_app.bench.servers import ServeRun
from serve_app.bench.stats import percentile

WARM_UP_S = 5.0
VICTIM_KEY, ATTACKER_KEY, ADMIN_KEY = "sk-victim", "sk-attacker", "sk-operator"
KEYS = {
    VICTIM_KEY: {"tenant": "victim"},
    ATTACKER_KEY: {"tenant": "attacker"},
    ADMIN_KEY: {"tenant": "operator", "role": "admin"},
}


@dataclass(frozen=True)
class Shape:
    """One kind of attacker request: its route, how to make its body (given the model), and the statuses it may get."""

    name: str
    route: str
    body: Callable[[str], Any]
    expected: tuple[int, ...]
    content_type: str = "application/json"
    fresh: bool = False  # a new body each time (else one, made before the loop: the load generator shares the CPU)


def _chat(model: str, **extra: Any) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, **extra}


def _pinned(model: str, distinct: int) -> dict:
    """A Messages request whose system prompt (about 4 pages), new each time, asks to stay cached for an hour: the
    attacker's pins pile up to the half of the pool pins may hold."""
    system = [{"type": "text", "text": f"{distinct} " + "Rules of the house. " * 12, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    return {"model": model, "max_tokens": 4, "system": system, "messages": [{"role": "user", "content": "Say hi."}]}


def _schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def _nested(depth: int) -> dict:
    schema: dict = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


_counter = itertools.count()  # makes each "distinct" schema new to the server
ENUM_2000 = {"type": "string", "enum": [f"{i:060d}" for i in range(2000)]}
ENUM_450 = {"type": "string", "enum": [f"{i:060d}" for i in range(450)]}  # just within max_grammar_bytes
EBNF_20000 = "root ::= r0\n" + "\n".join(f'r{i} ::= "a" r{i + 1} | "b"' for i in range(20_000)) + '\nr20000 ::= "z"'

SHAPES = [
    Shape("enum_2000_schema", "/v1/chat/completions", lambda m: _chat(m, response_format=_schema(ENUM_2000)), (400,)),
    Shape("nested_200_schema", "/v1/chat/completions", lambda m: _chat(m, response_format=_schema(_nested(200))), (400,)),
    Shape("ebnf_20000_rules", "/v1/completions",
          lambda m: {"model": m, "prompt": "x", "max_tokens": 4, "structured_outputs": {"grammar": EBNF_20000}}, (400,)),
    Shape("enum_450_schema_distinct", "/v1/chat/completions",  # the largest a compile may be, a new one each time
          lambda m: _chat(m, response_format=_schema({**ENUM_450, "description": str(next(_counter))})), (200, 503),
          fresh=True),
    Shape("small_schemas_distinct", "/v1/chat/completions",
          lambda m: _chat(m, response_format=_schema({"type": "object", "properties": {f"k{next(_counter)}": {"type": "integer"}}})),
          (200,), fresh=True),
    Shape("completions_500_prompts_n16", "/v1/completions",
          lambda m: {"model": m, "prompt": [[1, 2, 3]] * 500, "n": 16, "max_tokens": 4}, (400,)),
    Shape("top_k_2_70", "/v1/chat/completions", lambda m: _chat(m, top_k=2**70), (400,)),
    Shape("repetition_penalty_1e-308", "/v1/chat/completions", lambda m: _chat(m, repetition_penalty=1e-308, temperature=1), (200,)),
    Shape("temperature_1e-308", "/v1/chat/completions", lambda m: _chat(m, temperature=1e-308), (200,)),
    Shape("token_id_2_63", "/v1/completions", lambda m: {"model": m, "prompt": [1, 2**63], "max_tokens": 4}, (400,)),
    Shape("message_4mb", "/v1/chat/completions",
          lambda m: {**_chat(m), "messages": [{"role": "user", "content": "word " * 800_000}]}, (413,)),
    Shape("message_1mb", "/v1/chat/completions",  # just under max_request_bytes: read, parsed, refused on its characters
          lambda m: {**_chat(m), "messages": [{"role": "user", "content": "word " * 200_000}]}, (400,)),
    Shape("count_tokens_1mb", "/v1/messages/count_tokens",
          lambda m: {"model": m, "messages": [{"role": "user", "content": "word " * 200_000}]}, (400,)),
    Shape("text_plain_body", "/v1/chat/completions", _chat, (415,), content_type="text/plain"),
    Shape("logit_bias_5000", "/v1/chat/completions", lambda m: _chat(m, logit_bias={str(i): 1 for i in range(5000)}), (400,)),
    Shape("tokenize_1mb", "/tokenize", lambda m: {"model": m, "prompt": "word " * 200_000}, (400,)),
    Shape("embeddings_1000_inputs", "/v1/embeddings", lambda m: {"model": m, "input": ["word"] * 1000}, (400,)),
    Shape("embeddings_128_long", "/v1/embeddings",  # the most inputs a request may have, each some 60 tokens
          lambda m: {"model": m, "input": [f"{i} " + "a few words of text " * 12 for i in range(128)]}, (200,)),
    Shape("pinned_prefixes_distinct", "/v1/messages", lambda m: _pinned(m, next(_counter)), (200,), fresh=True),
    Shape("kv_lookup_as_user", "/v1/kv/lookup", lambda m: {"tokens": [1, 2, 3]}, (403,)),
]


@dataclass
class Phase:
    """What the victim saw while one shape ran (or alone, for the baseline), and how the attacker was answered."""

    shape: str
    victim_requests: int = 0
    victim_failures: int = 0
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    attacker_statuses: Counter = field(default_factory=Counter)
    attacker_times: list[float] = field(default_factory=list)
    unexpected: Counter = field(default_factory=Counter)

    def summary(self, baseline: Phase | None) -> dict[str, Any]:
        ttft_p99, gap_p99 = percentile(self.ttft, 99), percentile(self.gaps, 99)
        row: dict[str, Any] = {
            "shape": self.shape,
            "attacker": dict(self.attacker_statuses),
            "attacker_unexpected": dict(self.unexpected),
            "attacker_p50_s": round(percentile(self.attacker_times, 50), 3),
            "attacker_max_s": round(max(self.attacker_times, default=0.0), 3),
            "victim_requests": self.victim_requests,
            "victim_failures": self.victim_failures,
            "victim_ttft_p50_s": round(percentile(self.ttft, 50), 3),
            "victim_ttft_p99_s": round(ttft_p99, 3),
            "victim_itl_p50_ms": round(1000 * percentile(self.gaps, 50), 1),
            "victim_itl_p99_ms": round(1000 * gap_p99, 1),
        }
        if baseline is not None:
            row["ttft_p99_ratio"] = round(ttft_p99 / max(percentile(baseline.ttft, 99), 1e-6), 2)
            row["itl_p99_ratio"] = round(gap_p99 / max(percentile(baseline.gaps, 99), 1e-6), 2)
        return row


async def _victim(session: aiohttp.ClientSession, url: str, model: str, key: str | None, phase: Phase,
                  until: float, period_s: float, max_tokens: int) -> None:
    """Streamed chats, one every `period_s`, each timed: TTFT and the gaps between its content chunks."""
    prompts = make_prompts(32, seed=7, long_every=0)
    turn = 0
    while time.monotonic() < until:
        started = time.monotonic()
        body = {"model": model, "messages": [{"role": "user", "content": prompts[turn % len(prompts)]}],
                "max_tokens": max_tokens, "stream": True}
        turn += 1
        phase.victim_requests += 1
        try:
            first, last, done = None, None, False
            async with session.post(f"{url}/v1/chat/completions", json=body, headers=_auth(key)) as response:
                if response.status != 200:
                    raise RuntimeError(f"status {response.status}")
                async for line in response.content:
                    now = time.monotonic()
                    if line.startswith(b"data: [DONE]"):
                        done = True
                    elif line.startswith(b"data: {") and b'"content"' in line:
                        if first is None:
                            first = now
                            phase.ttft.append(now - started)
                        elif last is not None:
                            phase.gaps.append(now - last)
                        last = now
            if not done:
                raise RuntimeError("stream ended without [DONE]")
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError):
            phase.victim_failures += 1
        await asyncio.sleep(max(0.0, period_s - (time.monotonic() - started)))


async def _attacker(session: aiohttp.ClientSession, url: str, model: str, key: str | None, shape: Shape,
                    phase: Phase, until: float, rate: float) -> None:
    """`shape` again and again, `rate` a second at most (0: each as soon as the last is answered)."""
    payload = json.dumps(shape.body(model)).encode()
    headers = {**_auth(key), "content-type": shape.content_type}
    while time.monotonic() < until:
        if shape.fresh:
            payload = json.dumps(shape.body(model)).encode()
        started = time.monotonic()
        try:
            async with session.post(f"{url}{shape.route}", data=payload, headers=headers) as response:
                await response.read()
                status = response.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            status = type(error).__name__
        phase.attacker_times.append(time.monotonic() - started)
        phase.attacker_statuses[str(status)] += 1
        if status not in shape.expected:
            phase.unexpected[str(status)] += 1
        if rate > 0:
            await asyncio.sleep(max(0.0, 1 / rate - (time.monotonic() - started)))


def _auth(key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


async def _phase(url: str, model: str, keys: tuple[str | None, str | None], shape: Shape | None, seconds: float,
                 victims: int, attackers: int, rate: float, period_s: float, max_tokens: int, deadline_s: float) -> Phase:
    phase = Phase(shape.name if shape is not None else "baseline")
    until = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=max(deadline_s, 60.0))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        work = [_victim(session, url, model, keys[0], phase, until, period_s, max_tokens) for _ in range(victims)]
        if shape is not None:
            work += [_attacker(session, url, model, keys[1], shape, phase, until, rate) for _ in range(attackers)]
        await asyncio.gather(*work)
    return phase


def run_abuse(url: str, model: str, keys: tuple[str | None, str | None], shapes: list[Shape], seconds: float,
              victims: int = 2, attackers: int = 2, rate: float = 5.0, period_s: float = 1.0, max_tokens: int = 24,
              deadline_s: float = 5.0) -> list[dict[str, Any]]:
    """The baseline, then one phase per shape: their summaries (the baseline's first). A few seconds of the victim
    alone come first, unmeasured: a fresh server's first requests are slower than its later ones."""
    args = (victims, attackers, rate, period_s, max_tokens, deadline_s)
    asyncio.run(_phase(url, model, keys, None, min(seconds, WARM_UP_S), *args))
    baseline = asyncio.run(_phase(url, model, keys, None, seconds, *args))
    rows = [baseline.summary(None)]
    print(json.dumps(rows[0]), flush=True)
    for shape in shapes:
        row = asyncio.run(_phase(url, model, keys, shape, seconds, *args)).summary(baseline)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def problems(rows: list[dict[str, Any]], deadline_s: float, max_ttft_ratio: float) -> list[str]:
    """Where a phase missed the target."""
    found = []
    for row in rows:
        name = row["shape"]
        if row["victim_failures"]:
            found.append(f"{name}: the victim lost {row['victim_failures']} of {row['victim_requests']} requests")
        if row["attacker_unexpected"]:
            found.append(f"{name}: the attacker got {row['attacker_unexpected']}")
        if row["attacker_max_s"] > deadline_s:
            found.append(f"{name}: an attacker request took {row['attacker_max_s']} s (over {deadline_s} s)")
        if row.get("ttft_p99_ratio", 0.0) > max_ttft_ratio:
            found.append(f"{name}: the victim's TTFT p99 was {row['ttft_p99_ratio']}x its baseline")
    return found


def _stats(url: str) -> dict[str, int]:
    import httpx

    return httpx.get(f"{url}/stats", headers=_auth(ADMIN_KEY), timeout=10).json()


def main(args: argparse.Namespace) -> None:
    chosen = [s for s in SHAPES if not args.shapes or s.name in args.shapes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        keys_file = Path(tmp) / "keys.yaml"
        keys_file.write_text(yaml.safe_dump(KEYS))
        server = ServeRun(
            Path(tmp), engine_kwargs={"cache_tokens": 8192, "max_model_len": 2048}, model=args.model,
            args={"api_keys_file": str(keys_file)},
        )
        try:
            rows = run_abuse(server.url, server.model_id, (VICTIM_KEY, ATTACKER_KEY), chosen, args.seconds, args.victims,
                             args.attackers, args.attacker_rate, args.period, args.max_tokens, args.answer_deadline)
            deadline = time.monotonic() + 60
            while not (idle := is_idle(_stats(server.url))) and time.monotonic() < deadline:
                time.sleep(0.5)
        finally:
            server.stop()
    found = problems(rows, args.answer_deadline, args.max_ttft_ratio)
    if not idle:
        found.append("the server was not idle with every KV page back within 60 s")
    _print_table(rows)
    print(f"problems: {found or 'none'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "problems": found}, indent=2))
    if found:
        raise SystemExit(1)


def _print_table(rows: list[dict[str, Any]]) -> None:
    print("| shape | attacker statuses | attacker p50 / max s | victim TTFT p50 / p99 s | x baseline | ITL p50 / p99 ms | x baseline | victim lost |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        statuses = ", ".join(f"{count} x {status}" for status, count in sorted(r["attacker"].items())) or "-"
        print(f"| {r['shape']} | {statuses} | {r['attacker_p50_s']} / {r['attacker_max_s']} | "
              f"{r['victim_ttft_p50_s']} / {r['victim_ttft_p99_s']} | {r.get('ttft_p99_ratio', '-')} | "
              f"{r['victim_itl_p50_ms']} / {r['victim_itl_p99_ms']} | {r.get('itl_p99_ratio', '-')} | "
              f"{r['victim_failures']} of {r['victim_requests']} |")
