"""This machine's CPU (model and flags, recorded with every benchmark run), its fp32 matrix-multiply rate, and the
decode ceiling it implies for a model."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

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


# The instruction sets a kernel choice turns on, named in a run's one-line summary (every flag is kept too).
_NOTED_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")


@dataclass(frozen=True)
class CpuInfo:
    """What a benchmark figure depends on: the CPU's model name, its flags, and the cores the run had."""

    model: str
    flags: tuple[str, ...]
    cores: int

    @classmethod
    def here(cls) -> CpuInfo:
        """This machine's, from /proc/cpuinfo where there is one (else what `platform` says)."""
        fields: dict[str, str] = {}
        cpuinfo = Path("/proc/cpuinfo")
        if cpuinfo.is_file():
            for line in cpuinfo.read_text().splitlines():
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if not line.strip() and fields:
                    break  # the first processor's block
        model = fields.get("model name") or platform.processor() or platform.machine()
        return cls(model, tuple(fields.get("flags", "").split()), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)

    def summary(self) -> str:
        """One line: the model, the cores, and the noted instruction sets it has."""
        noted = [flag for flag in _NOTED_FLAGS if flag in self.flags]
        return f"{self.model}, {self.cores} cores ({' '.join(noted) or 'none of ' + ' '.join(_NOTED_FLAGS)})"
