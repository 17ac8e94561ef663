"""This machine's fp32 matrix-multiply rate, and the decode ceiling it implies for a model."""

from __future__ import annotations

import time

import torch


def matmul_gflops(size: int = 1024, seconds: float = 1.0) -> float:
    """Sustained fp32 GFLOP/s of square matrix products on the CPU with torch's threads."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)
    count = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        count += 1
    elapsed = time.perf_counter() - start
    return 2 * size**3 * count / elapsed / 1e9


def decode_ceiling_tok_s(gflops: float, n_params: int) -> float:
    """Tokens per second if every token cost only its matrix products (about 2 FLOPs per parameter)."""
    return gflops * 1e9 / (2 * n_params)
