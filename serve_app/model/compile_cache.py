"""Where the compiled forward's artifacts live: torch's own compile caches (inductor's FX graph cache,
AOTAutograd's cache, the C++ and Triton kernels), in a folder under the model cache named by what the
artifacts depend on (model, dtype, quantization, torch version, device and CPU features), and the
counters that say whether a start compiled or loaded them.
"""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

# The counters of torch's compile caches (`torch._dynamo.utils.counters`) a start reports.
_CACHE_COUNTERS = {
    "fx_graph_hits": ("inductor", "fxgraph_cache_hit"),
    "fx_graph_misses": ("inductor", "fxgraph_cache_miss"),
    "aot_autograd_hits": ("aot_autograd", "autograd_cache_hit"),
    "aot_autograd_misses": ("aot_autograd", "autograd_cache_miss"),
}


@dataclass(frozen=True)
class CompileCacheCounts:
    """Lookups in torch's compile caches: a graph found on disk (hit) or compiled and stored (miss)."""

    fx_graph_hits: int = 0
    fx_graph_misses: int = 0
    aot_autograd_hits: int = 0
    aot_autograd_misses: int = 0

    @classmethod
    def now(cls) -> CompileCacheCounts:
        from torch._dynamo.utils import counters

        return cls(**{name: counters[group][key] for name, (group, key) in _CACHE_COUNTERS.items()})

    def __sub__(self, earlier: CompileCacheCounts) -> CompileCacheCounts:
        return CompileCacheCounts(**{name: getattr(self, name) - getattr(earlier, name) for name in _CACHE_COUNTERS})

    @property
    def loaded(self) -> bool:
        """Every graph came from the cache."""
        return self.fx_graph_misses == 0 and self.aot_autograd_misses == 0 and self.fx_graph_hits > 0

    def describe(self) -> str:
        return (
            f"graphs from the cache {self.fx_graph_hits}, compiled {self.fx_graph_misses}"
            f" (AOTAutograd: {self.aot_autograd_hits} from the cache, {self.aot_autograd_misses} compiled)"
        )


def compile_cache_dir(cache_dir: Path, model_path: Path, dtype: torch.dtype, quantization: str, device: torch.device) -> Path:
    """The folder torch's compile caches use for this model and configuration."""
    identity = {
        "model": str(model_path.resolve()),
        "weights": _weights_identity(model_path),
        "dtype": str(dtype),
        "quantization": quantization,
        "torch": torch.__version__,
        "device": _device_identity(device),
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir) / "compile" / f"{model_path.name}-{digest}"


def _weights_identity(model_path: Path) -> list[tuple[str, int, int]]:
    """The model folder's files by name, size and modification time: new weights, new folder."""
    return sorted(
        (item.name, item.stat().st_size, item.stat().st_mtime_ns) for item in model_path.iterdir() if item.is_file()
    )


def _device_identity(device: torch.device) -> dict[str, object]:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return {"cuda": torch.cuda.get_device_name(index), "capability": list(torch.cuda.get_device_capability(index))}
    return {"machine": platform.machine(), "capability": torch.backends.cpu.get_cpu_capability(), "flags": _cpu_flags()}


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux's /proc/cpuinfo), which the C++ kernels are built for."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith(("flags", "Features")):
                    return hashlib.sha256(line.split(":", 1)[1].strip().encode()).hexdigest()[:16]
    except OSError:
        pass
    return platform.processor()
