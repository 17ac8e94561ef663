"""The compiled forward (`compile: true`): the whole model through `torch.compile` (inductor), its
attention an opaque custom op (`serve_app::paged_attention`), token counts dynamic.

Compiling happens at start, on the shapes a step can take (dynamo gives sizes 0 and 1 graphs of
their own: one decode row; one prefill chunk sampling one row; several rows), so that no request
waits for a compile, and steady state recompiles nothing. Every step's shape then has its graph, so
steps check only the guards that tell those graphs apart (dynamo's `skip_guard_eval_unsafe`): the
model's full guard set took about 1 ms a step, 3% of an int8 decode step at one client.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from serve_app.kv.storage import Storage
from serve_app.kv.view import BatchEntry, KVCacheView
from serve_app.model.attention import step_context

logger = logging.getLogger(__name__)

# (tokens in the step, rows sampled): one decode; a prefill sampling its last row; a mixed step.
WARM_UP_SHAPES = ((1, 1), (5, 1), (7, 3))


def compile_forward(
    model: torch.nn.Module, storage: Storage, decode_kernel: Callable | None, freezing: bool
) -> Callable[..., Any]:
    """The compiled model's forward, already run (into the cache's first pages, before anything is
    cached) on every shape class of a step. With `freezing` the weights become constants of the
    graph: folded, and prepacked for the CPU's matrix multiply."""
    options = {"freezing": True} if freezing else {}
    compiled = torch.compile(model, dynamic=True, fullgraph=True, options=options)
    started = time.perf_counter()
    logger.info("compiling the forward (torch.compile, inductor) for %d step shapes ...", len(WARM_UP_SHAPES))
    for tokens, rows in WARM_UP_SHAPES:
        run_dummy_step(compiled, storage, decode_kernel, tokens, rows)
    logger.info("compiled the forward in %.1f s", time.perf_counter() - started)

    def forward(**inputs: Any) -> Any:
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return compiled(**inputs)

    return forward


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
