"""`serve-app bench quant`: int8 weights (`quantization: int8`) against fp32, in one run on the same
prompts.

Agreement, teacher-forced: the fp32 engine decodes every prompt greedily (EOS ignored); then the
model's fp32 modules and the same modules quantized as the engine quantizes them read each prompt
followed by that continuation, and at every continuation position we compare their most likely
next token, and the int8 log-prob of fp32's token with fp32's own. Speed: output tok/s, TTFT and
TPOT of the two engines at each concurrency, alternating, one engine in the process at a time.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from serve_app.bench.engine_bench import run_engine_bench
from serve_app.bench.prompts import make_prompts
from serve_app.bench.stats import BenchRow, format_table
from serve_app.engine.engine import InferenceEngine
from serve_app.model.quantize import quantize_int8


@dataclass(frozen=True)
class Agreement:
    positions: int
    same_token: float  # share of positions where int8's most likely next token is fp32's
    mean_logprob_gap: float  # |int8 - fp32| log-prob of fp32's most likely token, averaged over positions


@torch.inference_mode()
def teacher_forced_agreement(model_path: str, sequences: Sequence[tuple[list[int], list[int]]]) -> Agreement:
    """Agreement over (prompt ids, fp32 greedy continuation) pairs; the model loaded from `model_path`."""
    from transformers import AutoModelForCausalLM

    fp32 = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    int8 = quantize_int8(copy.deepcopy(fp32), torch.device("cpu"))
    positions = same = 0
    gaps: list[float] = []
    for prompt, continuation in sequences:
        ids = torch.tensor([prompt + continuation])
        window = slice(len(prompt) - 1, ids.shape[1] - 1)  # the positions that predict the continuation
        reference = fp32(ids).logits[0, window].log_softmax(-1)
        quantized = int8(ids).logits[0, window].log_softmax(-1)
        best = reference.argmax(-1, keepdim=True)
        positions += best.shape[0]
        same += int((quantized.argmax(-1, keepdim=True) == best).sum())
        gaps.extend((quantized.gather(1, best) - reference.gather(1, best)).abs().flatten().tolist())
    return Agreement(positions, round(same / max(1, positions), 4), round(statistics.fmean(gaps), 4) if gaps else 0.0)


def main(args: argparse.Namespace) -> None:
    prompts = make_prompts(args.prompts, seed=args.seed)
    sequences: list[tuple[list[int], list[int]]] = []
    rows: list[BenchRow] = []
    model_path = args.model
    for concurrency in args.concurrency:
        for label, quantization in (("fp32", "none"), ("int8", "int8")):
            # One engine at a time: two scheduler threads in one process would fight over the cores.
            engine = InferenceEngine(model=args.model, quantization=quantization, cache_tokens=args.cache_tokens)
            try:
                if label == "fp32" and not sequences:
                    _, continuations = run_engine_bench(engine, prompts, 64, args.max_tokens, system=label, return_tokens=True)
                    sequences = [(engine.tokenizer.encode(p), c) for p, c in zip(prompts, continuations)]
                    model_path = str(engine.runner.path)
                run_engine_bench(engine, prompts[:4], 4, 4, system="warmup")
                rows.append(run_engine_bench(engine, prompts, concurrency, args.max_tokens, system=label))
            finally:
                engine.shutdown()
    measured = teacher_forced_agreement(model_path, sequences)
    print(format_table(rows))
    print(f"int8 against fp32, teacher-forced over {measured.positions} positions: same next token "
          f"{measured.same_token:.3f}, mean log-prob gap {measured.mean_logprob_gap:.4f}")
    for concurrency in args.concurrency:
        base, quantized = (next(r for r in rows if r.system == s and r.concurrency == concurrency) for s in ("fp32", "int8"))
        print(f"output tok/s, int8 / fp32 at concurrency {concurrency}: {quantized.output_tok_s / base.output_tok_s:.2f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": [r.as_dict() for r in rows], "agreement": asdict(measured)}, out, indent=2)
