"""`serve-app bench decode-kernel`: the paged decode-attention kernel timed on one layer's call, with its
pages in cache (warm) and after other memory traffic has gone through the caches (cold, as in a step,
where the layer's matrix products run between two calls), its pages in each of `--kv-dtype`'s element types;
`--against` another source of it (an earlier `paged_decode.c` of the same signature, say) times that one
alongside, alternating."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from serve_app.model.kernels.decode_kernel import DecodeKernel, build_decode_kernel
from serve_app.model.kernels.native import build_library

TRAFFIC_BYTES = 64 * 1024 * 1024


def _use_model_shape(args: argparse.Namespace) -> None:
    """With `--model`, its attention's heads, key/value heads and head dimension replace the options'."""
    if args.model is None:
        return
    from serve_app.config import default_cache_dir
    from serve_app.model.loader import resolve_model_path

    config = json.loads((resolve_model_path(args.model, default_cache_dir()) / "config.json").read_text())
    args.heads = config["num_attention_heads"]
    args.kv_heads = config.get("num_key_value_heads", args.heads)
    args.head_dim = config.get("head_dim") or config["hidden_size"] // args.heads


def _inputs(args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """Query rows, one layer's pages and each row's pages (scattered) and context length."""
    generator = torch.Generator().manual_seed(0)
    pages_per_row = -(-args.context // args.page_size)
    n_pages = args.rows * pages_per_row
    shape = (n_pages, args.page_size, args.kv_heads, args.head_dim)
    k, v = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    query = torch.randn(args.rows, args.heads, args.head_dim, generator=generator)
    tables = torch.randperm(n_pages, generator=generator).view(args.rows, pages_per_row).contiguous()
    lengths = torch.full((args.rows,), args.context, dtype=torch.int64)
    return query, k, v, tables, lengths


def _time(
    kernel: DecodeKernel, inputs: tuple[torch.Tensor, ...], scale: float, calls: int, traffic: torch.Tensor | None
) -> float:
    """Mean seconds a call, `traffic` (when given) streamed through the caches before each."""
    kernel(*inputs, scale)
    total = 0.0
    for _ in range(calls):
        if traffic is not None:
            traffic.add_(1.0)
        started = time.perf_counter()
        kernel(*inputs, scale)
        total += time.perf_counter() - started
    return total / calls


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    _use_model_shape(args)
    with tempfile.TemporaryDirectory(prefix="serve-app-kernel-") as cache:
        kernels = {"this kernel": build_decode_kernel(Path(cache))}
        if args.against:
            kernels[args.against] = DecodeKernel(*build_library(Path(args.against), Path(cache)))
        query, k, v, tables, lengths = _inputs(args)
        traffic = torch.ones(TRAFFIC_BYTES // 4)
        rows = []
        for round_ in range(args.rounds):
            for name, kernel in kernels.items():
                for dtype in args.kv_dtype:
                    inputs = (query, k.to(getattr(torch, dtype)), v.to(getattr(torch, dtype)), tables, lengths)
                    for state, flush in (("warm", None), ("cold", traffic)):
                        seconds = _time(kernel, inputs, args.head_dim**-0.5, args.calls, flush)
                        rows.append({"kernel": name, "kv_dtype": dtype, "round": round_, "caches": state,
                                     "ms_per_call": round(seconds * 1e3, 4)})
                        print(f"round {round_}  {name:>30}  {dtype:>8} pages  {state}: {seconds * 1e3:.3f} ms a call")
    if args.json:
        shape = {name: getattr(args, name) for name in ("rows", "heads", "kv_heads", "head_dim", "page_size", "context", "threads")}
        Path(args.json).write_text(json.dumps({"shape": shape, "rows": rows}, indent=2))
