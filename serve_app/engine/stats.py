"""engine_stats: an engine's counters as one flat dict (what `/stats`, the metrics and the activity log read):
the scheduler's counts and queues and its steps' sizes, the cache's pages and configuration, prefix-cache hits by tier, the KV tiers' usage,
speculative decoding's counts and the compiled forward's state."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Protocol

from serve_app.engine.scheduler import Scheduler, SchedulerStats
from serve_app.engine.speculation import SpeculationStats
from serve_app.wire.calls import TIER_NAMES

if TYPE_CHECKING:
    from serve_app.config import EngineConfig
    from serve_app.engine.loop import EngineLoop
    from serve_app.kv.base import KVCache
    from serve_app.kv.tiers.tier_chain import TierChain
    from serve_app.model.runner import ModelRunner


class EngineParts(Protocol):
    """What the stats and the start-up log read of an engine (an `InferenceEngine`'s parts)."""

    config: EngineConfig
    runner: ModelRunner
    cache: KVCache
    scheduler: Scheduler
    loop: EngineLoop
    tiers: TierChain | None
    max_model_len: int


def engine_stats(engine: EngineParts) -> dict[str, int]:
    stats = engine.scheduler.stats
    return {**_counters(engine, stats), **_tier_stats(engine, stats), **_speculation_stats(engine), **_compile_stats(engine)}


def _compile_stats(engine: EngineParts) -> dict[str, int]:
    """Whether steps run the compiled forward, its graphs this start loaded from torch's compile caches or
    compiled, and whether its fp32 linears run on oneDNN (where timing said it pays on this host)."""
    compiled = engine.runner.compiled
    return {
        "compiled_forward": int(compiled is not None),
        "compile_graphs_loaded": compiled.counts.fx_graph_hits if compiled is not None else 0,
        "compile_graphs_compiled": compiled.counts.fx_graph_misses if compiled is not None else 0,
        "compiled_linears_on_onednn": int(compiled is not None and compiled.linear_layout == "onednn"),
    }


def _counters(engine: EngineParts, stats: SchedulerStats) -> dict[str, int]:
    running, waiting = engine.loop.counts()
    usage = engine.cache.usage()
    adapters = engine.runner.adapters
    return {
        "total_tasks": stats.total_tasks,
        "total_tokens": stats.total_tokens,
        "active_tasks": running,
        "waiting_queue": waiting,
        "kv_pages_total": usage.total,
        "kv_pages_free": usage.free,
        "prefix_cache_queried_tokens": stats.prefix_cache_queried_tokens,
        "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens,
        "prompt_tokens": stats.prompt_tokens,
        "prefill_tokens": stats.prefill_tokens,
        "preemptions": stats.preemptions,
        "steps": stats.steps,
        "iteration_tokens_sum": stats.step_tokens_sum,
        **{f"iteration_tokens_bucket_{index}": count for index, count in enumerate(stats.step_tokens)},
        "kv_page_size": getattr(engine.cache, "page_size", 1),
        "prefix_caching": int(getattr(engine.cache, "enable_prefix_caching", False)),
        "lora_adapters_loaded": len(adapters.loaded()) if adapters is not None else 0,
        "lora_adapter_loads": adapters.loads if adapters is not None else 0,
    }


def _speculation_stats(engine: EngineParts) -> dict[str, int]:
    """Speculative decoding's counts (`SpeculationStats`), as `spec_decode_*`; zero when it is off."""
    speculator = engine.scheduler.speculator
    stats = speculator.stats if speculator is not None else SpeculationStats()
    return {f"spec_decode_{name}": value for name, value in asdict(stats).items()}


def _tier_stats(engine: EngineParts, stats: SchedulerStats) -> dict[str, int]:
    """Prefix-cache hits by tier (`prefix_cache_hit_tokens_pool`, `_host`, `_disk`, `_cluster`), and with
    tiers each one's bytes, pages, evictions (and the disk's corrupt pages found)."""
    loading = engine.scheduler.tiers
    by_tier = dict(loading.hit_tokens) if loading is not None else dict.fromkeys(TIER_NAMES, 0)
    out = {"prefix_cache_hit_tokens_pool": stats.prefix_cache_hit_tokens - sum(by_tier.values())}
    out |= {f"prefix_cache_hit_tokens_{tier}": tokens for tier, tokens in by_tier.items()}
    tiers = engine.tiers
    if tiers is not None:
        for tier, usage in tiers.usage().items():
            out |= {f"kv_tier_{tier}_bytes": usage.bytes, f"kv_tier_{tier}_pages": usage.pages,
                    f"kv_tier_{tier}_evictions": usage.evictions}
            if tier == "disk":
                out["kv_tier_disk_corrupt_pages"] = usage.corrupt
        out |= {"kv_tier_writes_queued_bytes": tiers.queued_bytes, "kv_tier_writes_dropped": tiers.writes_dropped,
                "kv_tier_load_failures": tiers.load_failures}
    return out
