"""The engine's log: what it started with, one line each, then every `log_stats_interval_s` while it is busy
a line with its prompt and generation throughput, running and waiting requests, KV usage and prefix-cache
hit rate, as vLLM prints them."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from serve_app.metrics.catalog import kv_cache_usage

if TYPE_CHECKING:
    from serve_app.engine.stats import EngineParts

logger = logging.getLogger("serve_app.engine")


def log_start(engine: EngineParts) -> None:
    """One line each: model, dtype, device, threads, KV pages and tokens, the requests that fit at full
    context, and whether steps run the compiled forward."""
    runner, config = engine.runner, engine.config
    usage = engine.cache.usage()
    page_size = getattr(engine.cache, "page_size", 1)
    tokens = usage.total * page_size
    logger.info("model: %s (quantization %s)", runner.path, runner.quantization)
    logger.info("dtype: %s", str(runner.dtype).removeprefix("torch."))
    logger.info("device: %s", runner.device)
    logger.info("threads: %d", torch.get_num_threads())
    logger.info("KV cache: %d pages of %d tokens (%s)", usage.total, page_size, config.cache.kind)
    logger.info("KV cache: %d tokens", tokens)
    logger.info(
        "maximum concurrent requests at full context (%d tokens): %.2f (max_num_seqs %d)",
        engine.max_model_len, tokens / engine.max_model_len, config.scheduler.max_num_seqs,
    )
    compiled = runner.compiled
    logger.info("compiled forward: %s", "on" if compiled is not None else ("off" if not config.model.compile else "off (fell back to eager)"))


class ActivityLog:
    """A thread that reads `stats()` every `interval_s` and logs a line when anything moved since the last."""

    def __init__(self, stats: Callable[[], dict[str, Any]], interval_s: float) -> None:
        self._stats = stats
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-activity-log", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        last, at = self._stats(), time.monotonic()
        while not self._stop.wait(self._interval_s):
            now, stats = time.monotonic(), self._stats()
            line = activity_line(last, stats, now - at)
            if line is not None:
                logger.info("%s", line)
            last, at = stats, now


def activity_line(before: dict[str, Any], after: dict[str, Any], seconds: float) -> str | None:
    """The line for `seconds` between two stats snapshots; None when the engine was idle throughout."""
    def grew(key: str) -> int:
        return after.get(key, 0) - before.get(key, 0)

    running, waiting = after.get("active_tasks", 0), after.get("waiting_queue", 0)
    if not (grew("prefill_tokens") or grew("total_tokens") or running or waiting):
        return None
    usage = kv_cache_usage(after)
    queried = grew("prefix_cache_queried_tokens")
    hit_rate = f"{100 * grew('prefix_cache_hit_tokens') / queried:.1f}%" if queried else "-"
    return (
        f"prompt throughput: {grew('prefill_tokens') / seconds:.1f} tokens/s, "
        f"generation throughput: {grew('total_tokens') / seconds:.1f} tokens/s, "
        f"running: {running} reqs, waiting: {waiting} reqs, KV cache usage: {100 * usage:.1f}%, "
        f"prefix cache hit rate: {hit_rate}"
    )
