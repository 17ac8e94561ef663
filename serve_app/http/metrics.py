"""Prometheus metrics of the server: requests, tokens, latencies, and the engines' state at scrape time."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from serve_app.http.protocols.base import Choice, RequestObserver
from serve_app.kv.tiers.pages import TIER_NAMES

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineStateCollector:
    """Reads the latest engine stats snapshot when Prometheus scrapes."""

    def __init__(self) -> None:
        self.stats: dict[str, int] = {}

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        yield GaugeMetricFamily("serve_app_requests_running", "Requests being generated.", value=s.get("active_tasks", 0))
        yield GaugeMetricFamily("serve_app_requests_waiting", "Requests queued for admission.", value=s.get("waiting_queue", 0))
        total = s.get("kv_pages_total", 0)
        used = (total - s.get("kv_pages_free", 0)) / total if total else 0.0
        yield GaugeMetricFamily("serve_app_kv_cache_usage_ratio", "Fraction of KV cache pages in use or cached.", value=used)
        hits = CounterMetricFamily(
            "serve_app_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache, by the tier that held them.",
            labels=["tier"],
        )
        for tier in ("pool", *TIER_NAMES):
            hits.add_metric([tier], s.get(f"prefix_cache_hit_tokens_{tier}", 0))
        yield hits
        held = [tier for tier in TIER_NAMES if f"kv_tier_{tier}_bytes" in s]
        if held:
            size = GaugeMetricFamily("serve_app_kv_tier_bytes", "Bytes of KV pages a tier holds.", labels=["tier"])
            evicted = CounterMetricFamily("serve_app_kv_tier_evictions", "KV pages a tier let go to make room.",
                                          labels=["tier"])
            for tier in held:
                size.add_metric([tier], s[f"kv_tier_{tier}_bytes"])
                evicted.add_metric([tier], s[f"kv_tier_{tier}_evictions"])
            yield size
            yield evicted
            yield CounterMetricFamily("serve_app_kv_tier_corrupt_pages", "Disk page files found corrupt (recomputed).",
                                      value=s.get("kv_tier_disk_corrupt_pages", 0))
        yield CounterMetricFamily("serve_app_preemptions", "Requests preempted by recompute.", value=s.get("preemptions", 0))
        yield from _speculation_metrics(s)


def _speculation_metrics(s: dict[str, int]) -> Iterator[Metric]:
    """Speculative decoding's counters (as vLLM's `spec_decode_*`) and its acceptance rate since start."""
    counts = {
        "num_drafts": ("drafts", "Decode rows verified with proposed tokens."),
        "num_draft_tokens": ("draft_tokens", "Tokens proposed."),
        "num_accepted_tokens": ("accepted_tokens", "Proposed tokens accepted."),
        "num_emitted_tokens": ("emitted_tokens", "Tokens the verified rows emitted: accepted ones plus one each."),
    }
    for name, (stat, help_text) in counts.items():
        yield CounterMetricFamily(f"serve_app_spec_decode_{name}", help_text, value=s.get(f"spec_decode_{stat}", 0))
    proposed = s.get("spec_decode_draft_tokens", 0)
    rate = s.get("spec_decode_accepted_tokens", 0) / proposed if proposed else 0.0
    yield GaugeMetricFamily("serve_app_spec_decode_acceptance_rate", "Proposed tokens accepted, as a share.", value=rate)


class ServerMetrics(RequestObserver):
    """One registry per server process; request metrics are observed as requests finish."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "serve_app_requests", "Finished requests (choices) by finish reason.", ["finish_reason"], registry=self.registry
        )
        self.prompt_tokens = Counter("serve_app_prompt_tokens", "Prompt tokens of finished requests.", registry=self.registry)
        self.generation_tokens = Counter("serve_app_generation_tokens", "Generated tokens.", registry=self.registry)
        self.ttft = Histogram(
            "serve_app_time_to_first_token_seconds", "Time to the first token.", buckets=_LATENCY_BUCKETS, registry=self.registry
        )
        self.tpot = Histogram(
            "serve_app_time_per_output_token_seconds", "Time between output tokens.", buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._engine_state = _EngineStateCollector()
        self.registry.register(self._engine_state)

    def on_finish(self, ttft: float | None, gaps: Sequence[float], choice: Choice) -> None:
        self.requests.labels(finish_reason=choice.finish_reason or "cancelled").inc()
        if choice.usage is not None:
            self.prompt_tokens.inc(choice.usage.prompt_tokens)
        self.generation_tokens.inc(len(choice.token_ids))
        if ttft is not None:
            self.ttft.observe(ttft)
        for gap in gaps:
            self.tpot.observe(gap)

    def render(self, engine_stats: dict[str, int]) -> bytes:
        self._engine_state.stats = engine_stats
        return generate_latest(self.registry)
