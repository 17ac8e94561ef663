"""ServerMetrics: the ingress's Prometheus registry, in the configured naming (`serve_app:*`, or vLLM's `vllm:*`).
Request metrics are observed as requests finish (and handed to a mirror, Ray's metrics on a cluster); the engines'
state is read from their stats at scrape time."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from serve_app.metrics.catalog import (
    ITERATION_TOKENS,
    NAMINGS,
    REQUEST_METRICS,
    MetricSpec,
    Naming,
    RequestTiming,
    Sample,
    engine_samples,
    iteration_tokens,
    request_samples,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SampleMirror(Protocol):
    def record(self, samples: Iterable[Sample]) -> None: ...


class _EngineStateCollector:
    """Every engine replica's state, from the stats it last reported, when Prometheus scrapes."""

    def __init__(self, naming: Naming) -> None:
        self.naming = naming
        self.replicas: dict[str, dict[str, Any]] = {}

    def collect(self) -> Iterator[Metric]:
        naming = self.naming
        families: dict[str, Metric] = {}

        def family(spec: MetricSpec, name: str) -> Metric:
            if name not in families:
                kind = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}
                families[name] = kind[spec.kind](name, spec.help, labels=naming.label_names(spec))
            return families[name]

        for replica, stats in self.replicas.items():
            model = str(stats.get("model"))
            for sample in engine_samples(stats, model, replica):
                for name in naming.names(sample.spec):
                    family(sample.spec, name).add_metric([sample.labels[key] for key in sample.spec.label_names], sample.value)
            steps = iteration_tokens(stats)
            if steps is not None:
                for name in naming.names(ITERATION_TOKENS):
                    family(ITERATION_TOKENS, name).add_metric([model, replica], buckets=steps[0], sum_value=steps[1])
        yield from families.values()


class ServerMetrics:
    """One registry per ingress replica (`replica`: its id), labelled so that many can be scraped together;
    `naming` is the server's `metrics_names`."""

    def __init__(self, replica: str = "in-process", mirror: SampleMirror | None = None, naming: str = "serve_app") -> None:
        self.replica = replica
        self.mirror = mirror
        self.registry = CollectorRegistry()
        names = NAMINGS[naming]
        self._requests: dict[MetricSpec, list[Counter | Histogram]] = {}
        for spec in REQUEST_METRICS:
            labels = names.label_names(spec)
            self._requests[spec] = [
                Counter(name, spec.help, labels, registry=self.registry) if spec.kind == "counter"
                else Histogram(name, spec.help, labels, buckets=spec.buckets, registry=self.registry)
                for name in names.names(spec)
            ]
        self._engine_state = _EngineStateCollector(names)
        self.registry.register(self._engine_state)

    def on_finish(self, model_name: str, timing: RequestTiming, reason: str, prompt_tokens: int, output_tokens: int) -> None:
        """A finished choice (the HTTP side's `RequestObserver`)."""
        self.record(request_samples(model_name, self.replica, timing, reason, prompt_tokens, output_tokens))

    def record(self, samples: list[Sample]) -> None:
        """A finished request's samples: counters grow by them, histograms observe them."""
        for sample in samples:
            values = [sample.labels[key] for key in sample.spec.label_names]
            for family in self._requests[sample.spec]:
                metric = family.labels(*values)
                if isinstance(metric, Counter):
                    metric.inc(sample.value)
                else:
                    metric.observe(sample.value)
        if self.mirror is not None:
            self.mirror.record(samples)

    def render(self, replicas: dict[str, dict[str, Any]]) -> bytes:
        """The exposition text, with `replicas` (each engine replica's stats and `model`) as the engines' state."""
        self._engine_state.replicas = replicas
        return generate_latest(self.registry)
