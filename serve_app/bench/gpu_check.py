"""`serve-app bench gpu-check` (`make gpu-check`): the engine on an accelerator, checked and measured.

1. The greedy oracle on the device: for each dtype, the engine's greedy tokens (every prompt
   submitted at once, so that they batch) against transformers' `generate` one prompt at a time on
   the same device and dtype. float32 must match token for token; in bfloat16 two correct
   implementations may part where two logits tie within rounding, so the report gives how many
   prompts match whole and the share of tokens before the first difference.
2. `bench compare` of the in-process systems on the device at bigger batches.
3. `bench quant` there: int8 and fp8 weights (torchao, weights only) against the unquantized model
   in the bench dtype, their teacher-forced agreement, log-prob gap and tok/s.
The cache is sized as a server's would be there (`gpu_memory_utilization`).
"""

from __future__ import annotations

import argparse
import gc
import json
from dataclasses import asdict, dataclass

import torch

from serve_app.bench.prompts import make_prompts
from serve_app.engine.engine import InferenceEngine
from serve_app.wire.requests import GenerateRequest


@dataclass(frozen=True)
class OracleResult:
    device: str
    dtype: str
    prompts: int
    equal_prompts: int
    agreeing_prefix: float  # tokens before each prompt's first difference, over all tokens


@torch.inference_mode()
def device_oracle(model: str, device: str, dtype: str, prompts: list[str], max_tokens: int) -> OracleResult:
    from transformers import AutoModelForCausalLM

    engine = InferenceEngine(model=model, device=device, dtype=dtype, max_model_len=2048)
    try:
        ids = [engine.tokenizer.encode(p) for p in prompts]
        results = [engine.submit(GenerateRequest(prompt=i, max_tokens=max_tokens, temperature=0, ignore_eos=True)) for i in ids]
        ours = [r.wait(600).token_ids for r in results]
        path = engine.runner.path
    finally:
        engine.shutdown()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    reference = reference.to(device).eval()
    equal = agreeing = 0
    for prompt, tokens in zip(ids, ours):
        prompt_ids = torch.tensor([prompt], device=device)
        out = reference.generate(
            prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=max_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )
        theirs = out[0, len(prompt) :].tolist()
        equal += tokens == theirs
        agreeing += next((i for i, (a, b) in enumerate(zip(tokens, theirs)) if a != b), min(len(tokens), len(theirs)))
    del reference
    _release(device)
    return OracleResult(device, dtype, len(ids), equal, round(agreeing / (len(ids) * max_tokens), 4))


def _release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def main(args: argparse.Namespace) -> None:
    from serve_app.bench import compare, quant_bench

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("serve-app bench gpu-check: CUDA is not available on this host (try --device cpu)")
    prompts = make_prompts(args.oracle_requests, seed=args.seed)
    oracle = [device_oracle(args.model, args.device, dtype, prompts, args.oracle_max_tokens) for dtype in args.dtypes]
    for result in oracle:
        print(f"greedy oracle on {result.device}, {result.dtype}: {result.equal_prompts}/{result.prompts} prompts equal "
              f"to transformers, {result.agreeing_prefix:.1%} of tokens before a first difference")
    compare.main(argparse.Namespace(
        systems=["engine", "hf-static", "hf-generate-batch"], concurrency=args.concurrency, requests=args.bench_requests,
        max_tokens=args.bench_max_tokens, sequential_requests=8, single_client_requests=16, seed=args.seed,
        device=args.device, dtype=args.bench_dtype, llama_server=None, gguf=[], json=None, plot=None,
        workloads=["completions"],
    ))
    quant_bench.main(argparse.Namespace(
        model=args.model, quantization=args.quantization, device=args.device, dtype=args.bench_dtype,
        requests=args.bench_requests, max_tokens=args.bench_max_tokens, concurrency=args.concurrency, cache_tokens=None,
        seed=args.seed, json=None,
    ))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"oracle": [asdict(r) for r in oracle]}, out, indent=2)
    if any(r.dtype == "float32" and r.equal_prompts != r.prompts for r in oracle):
        raise SystemExit("serve-app bench gpu-check: float32 greedy tokens differ from transformers'")
