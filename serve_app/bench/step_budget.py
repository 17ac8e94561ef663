"""`serve-app bench step-budget`: where one client's token goes in process -- the step's round (the forward, the
emitter's masks, sampling and acceptance, the rest of the scheduler's bookkeeping), what is left between rounds,
and the forward's operators by self CPU time (torch.profiler over decode steps, on the scheduler thread).

The parts are timed by wrapping the engine's own calls for one request after the timed ones, so TPOT with and
without the timers is reported apart.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from serve_app.bench.engine_bench import engine_form
from serve_app.engine.engine import InferenceEngine
from serve_app.wire.requests import GenerateRequest

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
WARM_STEPS = 8  # profiled rounds left out first (a decode step's shapes settle)


@dataclass(frozen=True)
class OperatorCost:
    name: str
    ms_per_step: float
    calls_per_step: float


@dataclass(frozen=True)
class StepBudget:
    tpot_ms: list[float]  # one client's time per output token, p50 of each timed request
    tpot_timed_ms: float  # the same with the parts' timers on
    round_ms: float  # p50 of one scheduler round: a decode step
    forward_ms: float
    emit_ms: float  # grammar masks, sampling, logprobs, accepting the token
    bookkeeping_ms: float  # the round's rest: scheduling, the cache's records, publishing
    between_rounds_ms: float  # TPOT's rest: the loop's own wake-ups
    operators_ms: float  # every operator's self CPU time a decode step: the forward's rest is Python's
    operators: list[OperatorCost]


def _tpot(engine: InferenceEngine, prompt: list[int], tokens: int) -> float:
    """p50 seconds between one request's output tokens."""
    stamps: list[float] = []
    request = GenerateRequest(prompt=prompt, max_tokens=tokens, temperature=0, ignore_eos=True)
    engine.submit(request, lambda delta: stamps.append(time.perf_counter()) if delta.token_ids else None).wait(600)
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


def _timed(into: list[float], call: Callable) -> Callable:
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)

    return timed


def measure(engine: InferenceEngine, tokens: int = 128, requests: int = 3, top: int = 20) -> StepBudget:
    from torch.profiler import ProfilerActivity, profile

    prompt = engine.tokenizer.encode_chat(PROMPT)
    _tpot(engine, prompt, 16)  # warm
    tpots = [_tpot(engine, prompt, tokens) for _ in range(requests)]
    loop, runner, emitter = engine.loop, engine.runner, engine.loop.step.emitter
    rounds: list[float] = []
    forwards: list[float] = []
    emits: list[float] = []
    loop._round = _timed(rounds, loop._round)  # instance attributes over the class's methods, removed below
    runner.forward = _timed(forwards, runner.forward)
    emitter.emit = _timed(emits, emitter.emit)
    try:
        timed_tpot = _tpot(engine, prompt, tokens)
    finally:
        del loop._round, runner.forward, emitter.emit
    profiles = []

    def profiled_round() -> None:
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            type(loop)._round(loop)
        profiles.append(profiler)

    loop._round = profiled_round
    try:
        _tpot(engine, prompt, WARM_STEPS + 32)
    finally:
        del loop._round
    steps = profiles[WARM_STEPS:]
    totals: dict[str, list[float]] = {}
    for profiler in steps:
        for event in profiler.key_averages():
            total = totals.setdefault(event.key, [0.0, 0.0])
            total[0] += event.self_cpu_time_total / 1000
            total[1] += event.count
    operators = [
        OperatorCost(name, ms / len(steps), calls / len(steps))
        for name, (ms, calls) in sorted(totals.items(), key=lambda item: -item[1][0])[:top]
    ]
    round_ms, forward_ms, emit_ms = (statistics.median(times) * 1000 for times in (rounds, forwards, emits))
    return StepBudget(
        [t * 1000 for t in tpots], timed_tpot * 1000, round_ms, forward_ms, emit_ms, round_ms - forward_ms - emit_ms,
        timed_tpot * 1000 - round_ms, sum(ms for ms, _ in totals.values()) / len(steps), operators,
    )


def main(args) -> None:
    engine = InferenceEngine(model=args.model, **engine_form(args))
    try:
        budget = measure(engine, args.tokens, args.requests)
    finally:
        engine.shutdown()
    print(f"TPOT p50 of each request: {', '.join(f'{t:.1f}' for t in budget.tpot_ms)} ms "
          f"({budget.tpot_timed_ms:.1f} ms with the parts timed)")
    print(f"a round {budget.round_ms:.2f} ms: forward {budget.forward_ms:.2f}, emit {budget.emit_ms:.2f}, "
          f"bookkeeping {budget.bookkeeping_ms:.2f}; between rounds {budget.between_rounds_ms:.2f} ms")
    print(f"the operators' self CPU time a decode step: {budget.operators_ms:.2f} ms in all; the most costly:")
    for op in budget.operators:
        print(f"  {op.ms_per_step:8.2f} ms  {op.calls_per_step:7.1f} calls  {op.name}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(asdict(budget), handle, indent=2)
