"""`serve-app bench quant`: quantized weights (`quantization: int8`, `int4`, `fp8`) and 16-bit KV caches
(`kv_cache_dtype`) against the unquantized model, in one run on the same prompts, on one device and dtype (the
CPU and float32 by default).

Agreement, teacher-forced: the unquantized engine decodes every prompt greedily (EOS ignored);
then the model's modules and the same modules quantized as the engine quantizes them read each
prompt followed by that continuation, and at every continuation position we compare their most
likely next token, and the quantized log-prob of the unquantized model's token with its own.
A 16-bit KV cache changes no weight, only what attention reads back: its engine decodes the same
prompts greedily, and its continuations are compared with the unquantized engine's token by token.
Speed: output tok/s, TTFT and TPOT of the engines at each concurrency, alternating, one engine in
the process at a time.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from serve_app.bench.engine_bench import run_engine_bench
from serve_app.bench.prompts import make_prompts
from serve_app.bench.stats import BenchRow, format_table
from serve_app.config import Quantization, default_cache_dir
from serve_app.engine.engine import InferenceEngine
from serve_app.model.loader import gguf_origin
from serve_app.model.quant.quantization import apply_quantization


@dataclass(frozen=True)
class Agreement:
    quantization: str
    positions: int
    same_token: float  # share of positions where the quantized model's most likely next token is the base's
    mean_logprob_gap: float  # |quantized - base| log-prob of the base's most likely token, averaged over positions
    one_row: bool = False  # the quantized model read the continuation one token a step, as one client decodes


@torch.inference_mode()
def teacher_forced_agreement(
    model_path: str, sequences: Sequence[tuple[list[int], list[int]]], quantization: Quantization = "int8",
    device: str = "cpu", dtype: str = "float32", one_row: bool = False, gguf: Path | None = None,
) -> Agreement:
    """Agreement over (prompt ids, greedy continuation) pairs; the model loaded from `model_path` (made from
    `gguf`, where int4 takes its Q4_1 weights).

    The quantized model reads each whole sequence in one forward (several rows a product, as a
    batch decodes), or with `one_row` its continuation a token at a time over its own cache (one
    row a product, as a single sequence decodes: int8 on the CPU runs another kernel there)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device).eval()
    quantized = apply_quantization(copy.deepcopy(base), quantization, torch.device(device), default_cache_dir(), gguf)
    positions = same = 0
    gaps: list[float] = []
    for prompt, continuation in sequences:
        ids = torch.tensor([prompt + continuation], device=device)
        window = slice(len(prompt) - 1, ids.shape[1] - 1)  # the positions that predict the continuation
        reference = base(ids).logits[0, window].float().log_softmax(-1)
        logits = _one_row_logits(quantized, ids, window.start) if one_row else quantized(ids).logits[0, window]
        candidate = logits.float().log_softmax(-1)
        best = reference.argmax(-1, keepdim=True)
        positions += best.shape[0]
        same += int((candidate.argmax(-1, keepdim=True) == best).sum())
        gaps.extend((candidate.gather(1, best) - reference.gather(1, best)).abs().flatten().tolist())
    del base, quantized
    gc.collect()
    return Agreement(
        quantization, positions, round(same / max(1, positions), 4), round(statistics.fmean(gaps), 4) if gaps else 0.0,
        one_row,
    )


@dataclass(frozen=True)
class GreedyAgreement:
    kv_cache_dtype: str
    prompts: int
    identical: int  # continuations equal to the base engine's, token for token
    tokens_before_divergence: float  # the share of continuation tokens before the first that differs


def greedy_agreement(kv_cache_dtype: str, base: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> GreedyAgreement:
    """How far each of `other`'s greedy continuations follows `base`'s (the same prompts, in order)."""
    before = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(base, other)]
    total = sum(len(x) for x in base)
    return GreedyAgreement(
        kv_cache_dtype, len(base), sum(x == list(y) for x, y in zip(base, other)), round(sum(before) / max(1, total), 4)
    )


def _one_row_logits(model: torch.nn.Module, ids: torch.Tensor, first: int) -> torch.Tensor:
    """The logits at positions `first ..` of `ids` [1, T], each from a forward of that one token over
    the cache of the tokens before it."""
    cache = model(ids[:, :first], use_cache=True).cache
    logits = []
    for position in range(first, ids.shape[1] - 1):
        output = model(ids[:, position : position + 1], cache=cache, use_cache=True)
        cache = output.cache
        logits.append(output.logits[0, -1])
    return torch.stack(logits)


def main(args: argparse.Namespace) -> None:
    prompts = make_prompts(args.requests, seed=args.seed)
    sequences: list[tuple[list[int], list[int]]] = []
    rows: list[BenchRow] = []
    model_path = args.model
    placement = {"device": args.device, "dtype": args.dtype}
    forms = [(args.dtype, {}), *((q, {"quantization": q}) for q in args.quantization),
             *((f"kv {d}", {"kv_cache_dtype": d}) for d in args.kv_cache_dtype)]
    kv_continuations: dict[str, list[list[int]]] = {}
    for concurrency in args.concurrency:
        for label, form in forms:
            # One engine at a time: two scheduler threads in one process would fight over the cores.
            engine = InferenceEngine(model=args.model, cache_tokens=args.cache_tokens, **form, **placement)
            try:
                if not form and not sequences:
                    _, continuations = run_engine_bench(engine, prompts, 64, args.max_tokens, system=label, return_tokens=True)
                    sequences = [(engine.tokenizer.encode(p), c) for p, c in zip(prompts, continuations)]
                    model_path = str(engine.runner.path)
                if "kv_cache_dtype" in form and form["kv_cache_dtype"] not in kv_continuations:
                    _, kv_continuations[form["kv_cache_dtype"]] = run_engine_bench(
                        engine, prompts, 64, args.max_tokens, system=label, return_tokens=True
                    )
                run_engine_bench(engine, prompts[:4], 4, 4, system="warmup")
                rows.append(run_engine_bench(engine, prompts, concurrency, args.max_tokens, system=label))
            finally:
                engine.shutdown()
                gc.collect()
    gguf = gguf_origin(args.model)
    measured = [teacher_forced_agreement(model_path, sequences, q, **placement, gguf=gguf) for q in args.quantization]
    if "int8" in args.quantization and args.device == "cpu":  # int8 on the CPU has a kernel of its own at one row
        measured.append(teacher_forced_agreement(model_path, sequences, "int8", **placement, one_row=True))
    greedy = [greedy_agreement(dtype, [c for _, c in sequences], tokens) for dtype, tokens in kv_continuations.items()]
    print(format_table(rows))
    for kv in greedy:
        print(f"KV cache in {kv.kv_cache_dtype} against {args.dtype}'s, greedy (64 in flight) over {kv.prompts} prompts: "
              f"{kv.identical} continuations identical, {kv.tokens_before_divergence:.3f} of the tokens before the first "
              "that differs")
    for agreement in measured:
        reading = "one token a step" if agreement.one_row else "whole sequences"
        print(f"{agreement.quantization} against {args.dtype}, teacher-forced ({reading}) over {agreement.positions} positions: "
              f"same next token {agreement.same_token:.3f}, mean log-prob gap {agreement.mean_logprob_gap:.4f}")
    for concurrency in args.concurrency:
        base = next(r for r in rows if r.system == args.dtype and r.concurrency == concurrency)
        for label, _ in forms[1:]:
            row = next(r for r in rows if r.system == label and r.concurrency == concurrency)
            print(f"output tok/s, {label} / {args.dtype} at concurrency {concurrency}: "
                  f"{row.output_tok_s / base.output_tok_s:.2f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": [r.as_dict() for r in rows], "agreement": [asdict(a) for a in measured],
                       "kv_cache_agreement": [asdict(kv) for kv in greedy]}, out, indent=2)
