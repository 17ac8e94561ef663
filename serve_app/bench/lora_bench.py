"""`serve-app bench lora`: the same requests on the base model alone and spread evenly over the base and
LoRA adapters, in one run (alternating, so that host drift hits both alike), with their throughput
ratio. The adapters are random rank-`--rank` PEFT folders on every targetable layer, written to a
temporary folder: what is measured is the per-row LoRA products, not what the adapters say."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from serve_app.bench.engine_bench import engine_form, run_engine_bench
from serve_app.bench.prompts import make_prompts
from serve_app.bench.stats import format_table
from serve_app.engine.engine import InferenceEngine
from serve_app.model.lora import TARGETS


def write_adapters(engine_model: str, folder: Path, count: int, rank: int) -> list[str]:
    """`count` random PEFT LoRA adapters of the model, each on every targetable layer; their names."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(engine_model, dtype=torch.float32)
    layers = {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in TARGETS and hasattr(m, "in_features")}
    names = []
    for index in range(count):
        generator = torch.Generator().manual_seed(index)
        tensors = {}
        for path, layer in layers.items():
            prefix = f"base_model.model.{path}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, layer.in_features, generator=generator) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(layer.out_features, rank, generator=generator) * 0.01
        name = f"bench-{index}"
        (folder / name).mkdir(parents=True)
        save_file(tensors, str(folder / name / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
        (folder / name / "adapter_config.json").write_text(json.dumps(config))
        names.append(name)
    return names


def main(args: argparse.Namespace) -> None:
    from serve_app.config import default_cache_dir
    from serve_app.model.loader import resolve_model_path

    path = resolve_model_path(args.model, default_cache_dir())
    with tempfile.TemporaryDirectory() as folder:
        names = write_adapters(str(path), Path(folder), args.adapters, args.rank)
        engine = InferenceEngine(
            model=str(path), dynamic_lora_loading_path=folder, max_num_adapters_per_replica=args.adapters,
            max_lora_rank=args.rank, **engine_form(args),
        )
        shares: list[str | None] = [None, *names]  # the base and each adapter, in even shares
        try:
            prompts = make_prompts(args.requests, seed=args.seed)
            for options_of in (None, lambda i: {"lora": shares[i % len(shares)]}):  # both kinds of step, once
                run_engine_bench(engine, prompts, max(args.concurrency), 8, system="warmup", options_of=options_of)
            rows = []
            for concurrency in args.concurrency:
                for _ in range(args.repeats):
                    rows.append(run_engine_bench(engine, prompts, concurrency, args.max_tokens, system="base"))
                    rows.append(run_engine_bench(engine, prompts, concurrency, args.max_tokens,
                                                 system=f"base+{args.adapters}-adapters",
                                                 options_of=lambda i: {"lora": shares[i % len(shares)]}))
        finally:
            engine.shutdown()
    print(format_table(rows))
    base = [r.output_tok_s for r in rows if r.system == "base"]
    mixed = [r.output_tok_s for r in rows if r.system != "base"]
    report = {"rows": [r.as_dict() for r in rows], "mixed_over_base_tok_s": [round(m / b, 3) for m, b in zip(mixed, base)]}
    print(json.dumps({"mixed_over_base_tok_s": report["mixed_over_base_tok_s"]}))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
