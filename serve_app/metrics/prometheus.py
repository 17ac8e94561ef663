"""ServerMetrics: the ingress's Prometheus registry. Request metrics are observed as requests finish (and
handed to a mirror, Ray's metrics on a cluster); the engines' state is read from their stats at scrape time."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from serve_app.http.protocols.base import RequestObserver
from serve_app.http.protocols.prepared import Choice
from serve_app.metrics.catalog import (
    REQUEST_METRICS,
    MetricSpec,
    RequestTiming,
    Sample,
    engine_samples,
    full_name,
    request_samples,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SampleMirror(Protocol):
    def record(self, samples: Iterable[Sample]) -> None: ...


class _EngineStateCollector:
    """Every engine replica's state, from the stats it last reported, when Prometheus scrapes."""

    def __init__(self) -> None:
        self.replicas: dict[str, dict[str, Any]] = {}

    def collect(self) -> Iterator[Metric]:
        families: dict[MetricSpec, GaugeMetricFamily | CounterMetricFamily] = {}
        for replica, stats in self.replicas.items():
            for sample in engine_samples(stats, str(stats.get("model")), replica):
                family = families.get(sample.spec)
                if family is None:
                    kind = CounterMetricFamily if sample.spec.kind == "counter" else GaugeMetricFamily
                    family = families[sample.spec] = kind(
                        full_name(sample.spec), sample.spec.help, labels=sample.spec.label_names
                    )
                family.add_metric([sample.labels[name] for name in sample.spec.label_names], sample.value)
        yield from families.values()


class ServerMetrics(RequestObserver):
    """One registry per ingress replica (`replica`: its id), labelled so that many can be scraped together."""

    def __init__(self, replica: str = "in-process", mirror: SampleMirror | None = None) -> None:
        self.replica = replica
        self.mirror = mirror
        self.registry = CollectorRegistry()
        self._requests: dict[MetricSpec, Counter | Histogram] = {}
        for spec in REQUEST_METRICS:
            if spec.kind == "counter":
                metric: Counter | Histogram = Counter(full_name(spec), spec.help, spec.label_names, registry=self.registry)
            else:
                metric = Histogram(
                    full_name(spec), spec.help, spec.label_names, buckets=spec.buckets, registry=self.registry
                )
            self._requests[spec] = metric
        self._engine_state = _EngineStateCollector()
        self.registry.register(self._engine_state)

    def on_finish(self, model_name: str, timing: RequestTiming, choice: Choice) -> None:
        prompt_tokens = choice.usage.prompt_tokens if choice.usage is not None else 0
        reason = choice.finish_reason or "cancelled"
        self.record(request_samples(model_name, self.replica, timing, reason, prompt_tokens, len(choice.token_ids)))

    def record(self, samples: list[Sample]) -> None:
        """A finished request's samples: counters grow by them, histograms observe them."""
        for sample in samples:
            metric = self._requests[sample.spec].labels(**sample.labels)
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
