"""The compiled forward (`compile: true`, the default): each decoder layer through `torch.compile`
(inductor), its attention an opaque custom op (`serve_app::paged_attention`), token counts dynamic;
embedding, final norm and head stay eager. On the CPU in fp32, every linear layer (the head too) first
moves its weight into oneDNN's layout (`onednn_linear.py`), as inductor's weight freezing would, where
timing both on this host says oneDNN's products are the faster.

Every layer runs the same graph (its weights and its layer number are the graph's inputs), so a
start traces and compiles one layer, not the whole model: about 10 s cold for the packaged model on
two cores, against about 170 s for the whole model, at the same step time (docs/compile.md). The
artifacts go to torch's compile caches in `compile_cache.compile_cache_dir`, so that a second start
of the same configuration loads them instead of compiling.

Compiling happens at start, on the shapes a step can take (dynamo gives size 1 a graph of its own:
one decode row; several tokens), so that no request waits for a compile, and steady state recompiles
nothing. Every step's shape then has its graph, so steps check only the guards that tell those graphs
apart (dynamo's `skip_guard_eval_unsafe`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from serve_app.kv.storage import Storage
from serve_app.kv.view import BatchEntry, KVCacheView
from serve_app.model.attention import LAYER_INDEX, step_context
from serve_app.model.compile_cache import CompileCacheCounts
from serve_app.model.kernels.onednn_linear import (
    BATCH_ROWS, onednn_supported, pack_linears, restore_linears, time_layouts,
)

logger = logging.getLogger(__name__)

LinearLayout = Literal["onednn", "aten"]  # where a compiled forward's fp32 linears run
_LAYOUT_RECORD = "linear-layout"  # in the compile cache folder: the layout its first start chose

# (tokens in the step, rows sampled): one decode; a mixed step of decodes and a prefill.
WARM_UP_SHAPES = ((1, 1), (7, 3))


@dataclass(frozen=True)
class CompiledForward:
    """A compiled forward, and how its start went: seconds spent, and what torch's caches held."""

    forward: Callable[..., Any]
    seconds: float
    cache_dir: Path
    counts: CompileCacheCounts
    linear_layout: LinearLayout


def compile_forward(
    model: torch.nn.Module, storage: Storage, decode_kernel: Callable | None, cache_dir: Path
) -> CompiledForward:
    """The model's forward with its decoder layers compiled, already run (into the cache's first
    pages, before anything is cached) on every shape class of a step, its artifacts read from and
    written to `cache_dir`."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    layers = decoder_layers(model)
    before = CompileCacheCounts.now()
    started = time.perf_counter()
    logger.info(
        "compiling the forward's %d decoder layers (torch.compile, inductor) for %d step shapes, cache %s: the "
        "first start of a configuration compiles, later ones load the cache", len(layers), len(WARM_UP_SHAPES), cache_dir,
    )
    linear_layout = recorded_linear_layout(model, layers, storage.device, cache_dir)
    if linear_layout == "onednn":
        logger.info("%d linear layers run on oneDNN, their weights in its layout", pack_linears(model))
    compile_layers(layers)
    try:
        # Floats (the attention's scale) as constants: a symbolic float makes dynamo trace the layer twice.
        with temporary_cache_dir(str(cache_dir)), torch._dynamo.config.patch(specialize_float=True):
            for index, (tokens, rows) in enumerate(WARM_UP_SHAPES, 1):
                shape_started, shape_before = time.perf_counter(), CompileCacheCounts.now()
                run_dummy_step(model, storage, decode_kernel, tokens, rows)
                logger.info(
                    "compiled step shape %d/%d (%d tokens, %d sampled rows) in %.1f s: %s", index,
                    len(WARM_UP_SHAPES), tokens, rows, time.perf_counter() - shape_started,
                    (CompileCacheCounts.now() - shape_before).describe(),
                )
    except BaseException:
        for layer in layers:
            layer._compiled_call_impl = None  # what `nn.Module.compile` set: the layer runs eager again
        restore_linears(model)
        raise
    seconds = time.perf_counter() - started
    counts = CompileCacheCounts.now() - before
    logger.info("compiled the forward in %.1f s (%s)", seconds, "loaded from the cache" if counts.loaded else "compiled")

    def forward(**inputs: Any) -> Any:
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return model(**inputs)

    return CompiledForward(forward, seconds, cache_dir, counts, linear_layout)


def recorded_linear_layout(
    model: torch.nn.Module, layers: torch.nn.ModuleList, device: torch.device, cache_dir: Path
) -> LinearLayout:
    """The layout this configuration's first start chose (`choose_linear_layout`) and recorded beside its
    compiled graphs, so that every later start runs the graphs it loads, and the same tokens."""
    record = cache_dir / _LAYOUT_RECORD
    if record.is_file():
        layout: LinearLayout = "onednn" if record.read_text().strip() == "onednn" else "aten"
        logger.info("linear layout %s, as this configuration's first start chose (%s)", layout, record)
        return layout
    layout = choose_linear_layout(model, layers, device)
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = record.with_suffix(f".{os.getpid()}")
    staging.write_text(layout)
    staging.replace(record)
    return layout


def choose_linear_layout(model: torch.nn.Module, layers: torch.nn.ModuleList, device: torch.device) -> LinearLayout:
    """`onednn` where oneDNN is here, the model's linears are fp32, and timing them on this host says it pays;
    else `aten` (`F.linear`)."""
    linears = [m for m in layers[0].modules() if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32]
    if not linears or not onednn_supported(device):
        return "aten"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    timing = time_layouts(linears, len(layers), head if type(head) is torch.nn.Linear else None)
    logger.info(
        "a token's linear products on this host: one row %.1f ms F.linear, %.1f ms oneDNN; %d rows %.1f ms F.linear, "
        "%.1f ms oneDNN: %s", timing.aten_one_row * 1e3, timing.onednn_one_row * 1e3, BATCH_ROWS,
        timing.aten_batch * 1e3, timing.onednn_batch * 1e3, "oneDNN" if timing.onednn_pays else "F.linear",
    )
    return "onednn" if timing.onednn_pays else "aten"


def compile_layers(layers: torch.nn.ModuleList) -> None:
    """Compile each decoder layer in place (`nn.Module.compile`), after giving its attention its layer
    number as a buffer, so that the layers share one graph."""
    for layer in layers:
        for module in layer.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                # On the CPU on every device: the attention op reads it as a Python int.
                module.register_buffer(LAYER_INDEX, torch.tensor(module.layer_idx), persistent=False)
        layer.compile(dynamic=True, fullgraph=True)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's stack of decoder layers: the list of modules each holding an attention with a layer number."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and all(
            any(isinstance(getattr(inner, "layer_idx", None), int) for inner in layer.modules()) for layer in module
        ):
            return module
    raise ValueError(f"{type(model).__name__} has no list of decoder layers with numbered attention")


def compile_unsupported(device: torch.device) -> str | None:
    """Why inductor cannot compile for `device` here, or None where it can."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is not installed"
    if device.type != "cpu":
        return f"the compiled forward is built for CPU and CUDA, not {device.type}"
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as error:  # inductor's InvalidCxxCompiler, or whatever its search raised
        return f"no C++ compiler for inductor ({type(error).__name__}; install g++ or set CXX)"
    return None


@torch.inference_mode()
def run_dummy_step(
    model: Callable, storage: Storage, decode_kernel: Callable | None, tokens: int, rows: int
) -> torch.Tensor:
    """One step of `rows - 1` decodes (one token each, at position 0) and one prefill of the rest, its
    k/v written into page 0 onwards; returns the logits of `rows` rows."""
    decodes = rows - 1 if tokens > rows - 1 else 0
    entries = [BatchEntry(task_id=i, start=0, num_new=1) for i in range(decodes)]
    entries.append(BatchEntry(task_id=decodes, start=0, num_new=tokens - decodes))
    pages = -(-tokens // storage.page_size)
    view = KVCacheView(storage, entries, [list(range(pages))] * len(entries))
    device = storage.device
    input_ids = torch.zeros(1, tokens, dtype=torch.long, device=device)
    positions = torch.tensor([[0] * decodes + list(range(tokens - decodes))], dtype=torch.long, device=device)
    keep = torch.arange(tokens - rows, tokens, dtype=torch.long, device=device)
    with step_context(view, decode_kernel):
        return model(input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=keep).logits
