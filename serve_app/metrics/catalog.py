"""Every metric the server exports: its name, kind and meaning (vLLM's wherever vLLM has one), how the names are
written (`serve_app:*` with a `replica` label, or vLLM's own `vllm:*` with `engine`), and the samples that a finished
request or an engine replica's stats amount to.

Each sample carries `model_name` and `replica`: the ingress replica that saw a request finish, or the
engine replica whose state it is."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from serve_app.wire.calls import ITERATION_TOKEN_BUCKETS, TIER_NAMES

COMMON_LABELS = ("model_name", "replica")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = tuple(float(step * 10**power) for power in range(6) for step in (1, 2, 5))  # 1, 2, 5, ..., 500000


@dataclass(frozen=True)
class MetricSpec:
    """One metric; `name` is without the namespace, and a counter's without `_total`."""

    name: str
    kind: Literal["counter", "gauge", "histogram"]
    help: str
    labels: tuple[str, ...] = ()  # beyond COMMON_LABELS
    buckets: tuple[float, ...] = LATENCY_BUCKETS  # a histogram's

    @property
    def label_names(self) -> tuple[str, ...]:
        return (*COMMON_LABELS, *self.labels)


@dataclass(frozen=True)
class Naming:
    """How the metrics are written: `<namespace>:<name>`, the replica's label, and whether vLLM's older names that
    dashboards still query are exported too (the same series under both names)."""

    namespace: str
    replica_label: str
    aliases: bool = False

    def label_names(self, spec: MetricSpec) -> tuple[str, ...]:
        return ("model_name", self.replica_label, *spec.labels)

    def names(self, spec: MetricSpec, separator: str = ":") -> tuple[str, ...]:
        """The metric's name, and its older vLLM name where this naming exports aliases."""
        alias = ALIASES.get(spec.name) if self.aliases else None
        return tuple(f"{self.namespace}{separator}{name}" for name in (spec.name, *([alias] if alias else [])))


SERVE_APP = Naming("serve_app", "replica")
VLLM = Naming("vllm", "engine", aliases=True)  # vLLM's names and labels, for its dashboards and autoscaler recipes
NAMINGS = {"serve_app": SERVE_APP, "vllm": VLLM}


@dataclass(frozen=True)
class Sample:
    spec: MetricSpec
    value: float
    labels: dict[str, str] = field(default_factory=dict)  # COMMON_LABELS and the spec's own


# Observed at the ingress as each request (each choice) finishes.
REQUEST_SUCCESS = MetricSpec(
    "request_success", "counter", "Finished requests (choices) by finish reason, error and cancelled included.",
    ("finished_reason",),
)
PROMPT_TOKENS = MetricSpec("prompt_tokens", "counter", "Prompt tokens of finished requests.")
GENERATION_TOKENS = MetricSpec("generation_tokens", "counter", "Generated tokens of finished requests.")
TIME_TO_FIRST_TOKEN = MetricSpec("time_to_first_token_seconds", "histogram", "Time from arrival to the first token.")
INTER_TOKEN_LATENCY = MetricSpec("inter_token_latency_seconds", "histogram", "Time between output tokens.")
E2E_REQUEST_LATENCY = MetricSpec("e2e_request_latency_seconds", "histogram", "Time from arrival to the last token.")
REQUEST_QUEUE_TIME = MetricSpec(
    "request_queue_time_seconds", "histogram", "Time a request waited in its engine's queue before admission."
)
REQUEST_PROMPT_TOKENS = MetricSpec(
    "request_prompt_tokens", "histogram", "Prompt tokens of each finished request.", buckets=TOKEN_BUCKETS
)
REQUEST_GENERATION_TOKENS = MetricSpec(
    "request_generation_tokens", "histogram", "Generated tokens of each finished request.", buckets=TOKEN_BUCKETS
)
REQUEST_MAX_GENERATION_TOKENS = MetricSpec(
    "request_max_num_generation_tokens", "histogram", "Generated tokens of each finished choice.", buckets=TOKEN_BUCKETS
)
REQUEST_PREFILL_TIME = MetricSpec(
    "request_prefill_time_seconds", "histogram", "From admission to the first token (time to first token less the queue)."
)
REQUEST_DECODE_TIME = MetricSpec("request_decode_time_seconds", "histogram", "From the first token to the last.")
REQUEST_INFERENCE_TIME = MetricSpec(
    "request_inference_time_seconds", "histogram", "From admission to the last token (prefill and decode)."
)
REQUEST_METRICS = (
    REQUEST_SUCCESS, PROMPT_TOKENS, GENERATION_TOKENS,
    TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, E2E_REQUEST_LATENCY, REQUEST_QUEUE_TIME,
    REQUEST_PROMPT_TOKENS, REQUEST_GENERATION_TOKENS, REQUEST_MAX_GENERATION_TOKENS,
    REQUEST_PREFILL_TIME, REQUEST_DECODE_TIME, REQUEST_INFERENCE_TIME,
)

# An engine replica's state, from its stats.
RUNNING = MetricSpec("num_requests_running", "gauge", "Requests being generated.")
WAITING = MetricSpec("num_requests_waiting", "gauge", "Requests waiting to be admitted.")
KV_CACHE_USAGE = MetricSpec(
    "kv_cache_usage_perc", "gauge",
    "KV cache pages held by requests, as a fraction (1 = full; cached pages no request holds count as free).",
)
PREFIX_CACHE_QUERIES = MetricSpec(
    "prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache, once per admission."
)
PREFIX_CACHE_HITS = MetricSpec(
    "prefix_cache_hits", "counter", "Of those, tokens found cached (in the page pool or a KV tier)."
)
PREFIX_CACHE_TIER_HITS = MetricSpec(
    "prefix_cache_tier_hits", "counter", "Prefix-cache hit tokens by where they were found.", ("tier",)
)
ENGINE_REQUESTS = MetricSpec("engine_requests", "counter", "Requests this engine replica was given (how routing spread them).")
PREEMPTIONS = MetricSpec("num_preemptions", "counter", "Requests preempted (their KV freed, recomputed later).")
SPEC_DECODE = {
    stat: MetricSpec(f"spec_decode_{name}", "counter", text)
    for stat, name, text in (
        ("drafts", "num_drafts", "Decode rows verified with proposed tokens."),
        ("draft_tokens", "num_draft_tokens", "Tokens proposed."),
        ("accepted_tokens", "num_accepted_tokens", "Proposed tokens accepted."),
        ("emitted_tokens", "num_emitted_tokens", "Tokens the verified rows emitted: accepted ones plus one each."),
    )
}
SPEC_DECODE_ACCEPTANCE = MetricSpec("spec_decode_acceptance_rate", "gauge", "Proposed tokens accepted, as a share.")
KV_TIER_BYTES = MetricSpec("kv_tier_bytes", "gauge", "Bytes of KV pages a tier holds.", ("tier",))
KV_TIER_EVICTIONS = MetricSpec("kv_tier_evictions", "counter", "KV pages a tier let go to make room.", ("tier",))
KV_TIER_CORRUPT = MetricSpec("kv_tier_corrupt_pages", "counter", "Disk page files found corrupt (recomputed).")
CACHE_CONFIG_INFO = MetricSpec(
    "cache_config_info", "gauge", "The KV cache's configuration, in its labels (the value is 1).",
    ("block_size", "num_gpu_blocks", "enable_prefix_caching"),
)
ENGINE_METRICS = (
    RUNNING, WAITING, KV_CACHE_USAGE, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, PREFIX_CACHE_TIER_HITS,
    ENGINE_REQUESTS, PREEMPTIONS, *SPEC_DECODE.values(), SPEC_DECODE_ACCEPTANCE,
    KV_TIER_BYTES, KV_TIER_EVICTIONS, KV_TIER_CORRUPT, CACHE_CONFIG_INFO,
)
# Read from an engine's stats as bucket counts (at scrape time only: Ray's histograms take observations).
ITERATION_TOKENS = MetricSpec(
    "iteration_tokens_total", "histogram", "Tokens per engine step (prompt and decode tokens of one forward).",
    buckets=tuple(float(bound) for bound in ITERATION_TOKEN_BUCKETS),
)

# vLLM's older names for the same series, which its published Grafana dashboard still queries.
ALIASES = {INTER_TOKEN_LATENCY.name: "time_per_output_token_seconds", KV_CACHE_USAGE.name: "gpu_cache_usage_perc"}


def full_name(spec: MetricSpec, separator: str = ":") -> str:
    """`serve_app:<name>` as Prometheus reads the ingress; Ray's metrics take `_` for the separator."""
    return SERVE_APP.names(spec, separator)[0]


def kv_cache_usage(stats: dict[str, Any]) -> float:
    """The share of an engine's KV pages held by requests (`kv_cache_usage_perc`)."""
    total = stats.get("kv_pages_total", 0)
    return (total - stats.get("kv_pages_free", 0)) / total if total else 0.0


def engine_samples(stats: dict[str, Any], model_name: str, replica: str) -> Iterator[Sample]:
    """What one engine replica's stats (`InferenceEngine.get_stats`) amount to."""
    common = {"model_name": model_name, "replica": replica}

    def sample(spec: MetricSpec, value: float, **labels: str) -> Sample:
        return Sample(spec, value, {**common, **labels})

    yield sample(RUNNING, stats.get("active_tasks", 0))
    yield sample(WAITING, stats.get("waiting_queue", 0))
    yield sample(KV_CACHE_USAGE, kv_cache_usage(stats))
    yield sample(PREFIX_CACHE_QUERIES, stats.get("prefix_cache_queried_tokens", 0))
    yield sample(PREFIX_CACHE_HITS, stats.get("prefix_cache_hit_tokens", 0))
    for tier in ("pool", *TIER_NAMES):
        yield sample(PREFIX_CACHE_TIER_HITS, stats.get(f"prefix_cache_hit_tokens_{tier}", 0), tier=tier)
    yield sample(ENGINE_REQUESTS, stats.get("total_tasks", 0))
    yield sample(PREEMPTIONS, stats.get("preemptions", 0))
    for stat, spec in SPEC_DECODE.items():
        yield sample(spec, stats.get(f"spec_decode_{stat}", 0))
    proposed = stats.get("spec_decode_draft_tokens", 0)
    yield sample(SPEC_DECODE_ACCEPTANCE, stats.get("spec_decode_accepted_tokens", 0) / proposed if proposed else 0.0)
    for tier in TIER_NAMES:
        if f"kv_tier_{tier}_bytes" in stats:
            yield sample(KV_TIER_BYTES, stats[f"kv_tier_{tier}_bytes"], tier=tier)
            yield sample(KV_TIER_EVICTIONS, stats[f"kv_tier_{tier}_evictions"], tier=tier)
    if "kv_tier_disk_corrupt_pages" in stats:
        yield sample(KV_TIER_CORRUPT, stats["kv_tier_disk_corrupt_pages"])
    if "kv_page_size" in stats:
        yield sample(
            CACHE_CONFIG_INFO, 1, block_size=str(stats["kv_page_size"]), num_gpu_blocks=str(stats["kv_pages_total"]),
            enable_prefix_caching=str(bool(stats.get("prefix_caching", 0))),
        )


def iteration_tokens(stats: dict[str, Any]) -> tuple[list[tuple[str, float]], float] | None:
    """An engine's tokens-per-step histogram from its stats: cumulative (bound, count) pairs ending at +Inf, and
    the sum (None where its stats have none)."""
    if "iteration_tokens_sum" not in stats:
        return None
    buckets, total = [], 0.0
    for index, bound in enumerate((*ITERATION_TOKEN_BUCKETS, None)):
        total += stats.get(f"iteration_tokens_bucket_{index}", 0)
        buckets.append(("+Inf" if bound is None else str(float(bound)), total))
    return buckets, float(stats["iteration_tokens_sum"])


@dataclass(frozen=True)
class RequestTiming:
    """When one request's tokens came, as its ingress saw them (queue time as its engine measured it)."""

    ttft_s: float | None = None  # None: no token came
    gaps_s: tuple[float, ...] = ()
    queue_time_s: float | None = None  # None: never admitted
    e2e_s: float | None = None  # None: it did not finish (closed before its last delta)


def request_samples(
    model_name: str, replica: str, timing: RequestTiming, finished_reason: str, prompt_tokens: int, generated: int
) -> list[Sample]:
    """What one finished request (one choice) amounts to: counter samples are increments, histogram samples
    observations."""
    common = {"model_name": model_name, "replica": replica}
    samples = [
        Sample(REQUEST_SUCCESS, 1, {**common, "finished_reason": finished_reason}),
        Sample(PROMPT_TOKENS, prompt_tokens, common),
        Sample(GENERATION_TOKENS, generated, common),
        Sample(REQUEST_PROMPT_TOKENS, prompt_tokens, common),
        Sample(REQUEST_GENERATION_TOKENS, generated, common),
    ]
    samples.append(Sample(REQUEST_MAX_GENERATION_TOKENS, generated, common))
    ttft, queue, e2e = timing.ttft_s, timing.queue_time_s, timing.e2e_s
    spans = (
        (TIME_TO_FIRST_TOKEN, ttft), (REQUEST_QUEUE_TIME, queue), (E2E_REQUEST_LATENCY, e2e),
        (REQUEST_PREFILL_TIME, _between(queue, ttft)), (REQUEST_DECODE_TIME, _between(ttft, e2e)),
        (REQUEST_INFERENCE_TIME, _between(queue, e2e)),
    )
    for spec, value in spans:
        if value is not None:
            samples.append(Sample(spec, value, common))
    samples.extend(Sample(INTER_TOKEN_LATENCY, gap, common) for gap in timing.gaps_s)
    return samples


def _between(start: float | None, end: float | None) -> float | None:
    """The time from one moment since arrival to a later one (None where either is unknown)."""
    return max(0.0, end - start) if start is not None and end is not None else None
