"""RayMetrics: samples recorded into Ray's metrics (`ray.util.metrics`), so a Ray cluster's Prometheus and
Grafana have them without scraping each ingress. Ray takes no `:` in a name: `serve_app_<name>`, which Ray's
exporter serves as `ray_serve_app_<name>`."""

from __future__ import annotations

from collections.abc import Iterable

from ray.util.metrics import Counter, Gauge, Histogram

from serve_app.metrics.catalog import MetricSpec, Sample, full_name


class RayMetrics:
    """Ray metrics for `specs`. With `totals`, a counter's samples are running totals (an engine's stats) and
    it grows by the difference; otherwise they are increments."""

    def __init__(self, specs: Iterable[MetricSpec], totals: bool = False) -> None:
        self._totals = totals
        self._last: dict[tuple[MetricSpec, tuple[str, ...]], float] = {}
        self._metrics: dict[MetricSpec, Counter | Gauge | Histogram] = {}
        for spec in specs:
            name, tags = full_name(spec, "_"), spec.label_names
            if spec.kind == "counter":
                self._metrics[spec] = Counter(name, spec.help, tag_keys=tags)
            elif spec.kind == "gauge":
                self._metrics[spec] = Gauge(name, spec.help, tag_keys=tags)
            else:
                self._metrics[spec] = Histogram(name, spec.help, boundaries=list(spec.buckets), tag_keys=tags)

    def record(self, samples: Iterable[Sample]) -> None:
        for sample in samples:
            metric = self._metrics[sample.spec]
            if isinstance(metric, Gauge):
                metric.set(sample.value, tags=sample.labels)
            elif isinstance(metric, Histogram):
                metric.observe(sample.value, tags=sample.labels)
            else:
                self._grow(metric, sample)

    def _grow(self, counter: Counter, sample: Sample) -> None:
        growth = sample.value
        if self._totals:
            key = (sample.spec, tuple(sample.labels.values()))
            growth = sample.value - self._last.get(key, 0.0)
            self._last[key] = sample.value
        if growth > 0:  # Ray's counters take only positive increments
            counter.inc(growth, tags=sample.labels)
