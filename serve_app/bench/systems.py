"""The systems `bench compare` runs, each over the same token-id prompts, greedy, ignoring EOS.

Each returns summary rows and the generated token ids (for the greedy-equality check).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from serve_app.bench.client import CompletionClient
from serve_app.bench.engine_bench import run_engine_bench
from serve_app.bench.stats import BenchRow, RequestTiming


@dataclass
class SystemResult:
    rows: list[BenchRow]
    tokens: list[list[int]]


def _timing_from_stamps(start: float, stamps: Sequence[float], tokens: int) -> RequestTiming:
    gaps = tuple(b - a for a, b in zip(stamps, stamps[1:]))
    return RequestTiming(ttft=stamps[0] - start if stamps else 0.0, gaps=gaps, output_tokens=tokens)


def prompts_at(prompts: list, concurrency: int, single_client_prompts: int) -> list:
    """The prompts one concurrency level runs: a single client runs only the first few (it is slow)."""
    return prompts[:single_client_prompts] if concurrency == 1 else prompts


@dataclass(frozen=True)
class Placement:
    """Where the in-process systems run: a device and dtype as the engine's config names them."""

    device: str = "cpu"
    dtype: str = "float32"

    def resolved(self) -> tuple[torch.device, torch.dtype]:
        from serve_app.model.runner import resolve_device, resolve_dtype

        device = resolve_device(self.device)
        return device, resolve_dtype(self.dtype, device)


def run_engine(
    model: str, prompts: list[list[int]], concurrencies: Sequence[int], max_tokens: int, single_client_prompts: int,
    placement: Placement = Placement(),
) -> SystemResult:
    from serve_app.engine.engine import InferenceEngine

    device, dtype = placement.resolved()
    max_num_seqs = max(256, *concurrencies)
    engine = InferenceEngine(
        model=model, kv_cache="paged", cache_tokens=65536, max_model_len=2048, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(512, max_num_seqs), device=str(device), dtype=str(dtype).removeprefix("torch."),
    )
    try:
        run_engine_bench(engine, prompts[:4], 4, 4, system="warmup")
        rows, tokens = [], []
        for concurrency in concurrencies:
            subset = prompts_at(prompts, concurrency, single_client_prompts)
            row, subset_tokens = run_engine_bench(engine, subset, concurrency, max_tokens, return_tokens=True)
            rows.append(row)
            if len(subset_tokens) >= len(tokens):
                tokens = subset_tokens
        return SystemResult(rows, tokens)
    finally:
        engine.shutdown()


class _StepClock:
    """A logits processor that only notes when each generation step happens."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


def _load_hf(path: Path, placement: Placement, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    device, dtype = placement.resolved()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn).to(device)
    model.eval()
    return model


def _greedy_kwargs(max_tokens: int) -> dict:
    return dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)


def run_hf_sequential(
    path: Path, prompts: list[list[int]], max_tokens: int, placement: Placement = Placement()
) -> SystemResult:
    """transformers `generate`, one request at a time."""
    from transformers import LogitsProcessorList

    model = _load_hf(path, placement)
    timings, tokens = [], []
    begin = time.perf_counter()
    with torch.inference_mode():
        for ids in prompts:
            clock = _StepClock()
            start = time.perf_counter()
            out = model.generate(
                torch.tensor([ids], device=model.device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=model.device),
                logits_processor=LogitsProcessorList([clock]), **_greedy_kwargs(max_tokens),
            )
            tokens.append(out[0, len(ids) :].tolist())
            timings.append(_timing_from_stamps(start, clock.stamps, len(tokens[-1])))
    row = BenchRow.from_timings("hf-sequential", 1, time.perf_counter() - begin, timings)
    return SystemResult([row], tokens)


def run_hf_static(
    path: Path, prompts: list[list[int]], max_tokens: int, placement: Placement = Placement()
) -> SystemResult:
    """transformers `generate` on one left-padded batch of every prompt."""
    from transformers import LogitsProcessorList

    model = _load_hf(path, placement)
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        mask[row, width - len(ids) :] = 1
    clock = _StepClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids.to(model.device), attention_mask=mask.to(model.device), logits_processor=LogitsProcessorList([clock]), **_greedy_kwargs(max_tokens)
        )
    duration = time.perf_counter() - start
    tokens = out[:, width:].tolist()
    timings = [_timing_from_stamps(start, clock.stamps, len(t)) for t in tokens]
    row = BenchRow.from_timings("hf-static", len(prompts), duration, timings)
    return SystemResult([row], tokens)


def run_hf_generate_batch(
    path: Path, prompts: list[list[int]], max_tokens: int, placement: Placement = Placement()
) -> SystemResult:
    """transformers' own continuous batching (`generate_batch`)."""
    from transformers import GenerationConfig

    model = _load_hf(path, placement, attn="sdpa")
    config = GenerationConfig(**_greedy_kwargs(max_tokens))
    model.generate_batch(inputs=prompts[:2], generation_config=config, progress_bar=False)  # warm-up
    start = time.perf_counter()
    with torch.inference_mode():
        outputs = model.generate_batch(
            inputs=prompts, generation_config=config, record_timestamps=True, progress_bar=False
        )
    duration = time.perf_counter() - start
    ordered = sorted(outputs.values(), key=lambda o: int(str(o.request_id).split("_")[-1]))
    tokens = [list(o.generated_tokens) for o in ordered]
    timings = [_timing_from_stamps(start, o.timestamps or [], len(o.generated_tokens)) for o in ordered]
    row = BenchRow.from_timings("hf-generate-batch", len(prompts), duration, timings)
    return SystemResult([row], tokens)


async def stream_requests(
    url: str, model: str, prompts: list, concurrency: int, max_tokens: int, api: str = "openai",
    close_connections: bool = False,
) -> tuple[float, list[RequestTiming]]:
    """Stream every prompt, `concurrency` at a time: the seconds it took, and each request's timing."""
    slots = asyncio.Semaphore(concurrency)
    async with CompletionClient(url, api=api, close_connections=close_connections) as client:

        async def one(prompt: list) -> RequestTiming:
            async with slots:
                return await client.stream(model, prompt, max_tokens)

        begin = time.perf_counter()
        timings = await asyncio.gather(*(one(prompt) for prompt in prompts))
        return time.perf_counter() - begin, list(timings)


def run_http(
    url: str,
    model: str,
    prompts: list,
    concurrencies: Sequence[int],
    max_tokens: int,
    single_client_prompts: int,
    system: str = "http",
    api: str = "openai",
    close_connections: bool = False,
) -> list[BenchRow]:
    """A server through its full HTTP path: streaming requests from an async client. Token-id prompts go
    to this server's OpenAI completions, or to llama-server's own `/completion` with `api="llama.cpp"`;
    chats (lists of messages) go to either's `/v1/chat/completions` with `api="chat"`."""
    asyncio.run(stream_requests(url, model, prompts[:4], 4, 4, api, close_connections))  # warm-up
    rows = []
    for concurrency in concurrencies:
        subset = prompts_at(prompts, concurrency, single_client_prompts)
        duration, timings = asyncio.run(
            stream_requests(url, model, subset, concurrency, max_tokens, api, close_connections)
        )
        rows.append(BenchRow.from_timings(system, concurrency, duration, timings))
    return rows
