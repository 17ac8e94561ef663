"""The Grafana dashboard in deploy/grafana/ parses, and every metric its queries name is one the server
exports: on an ingress's /metrics (`serve_app:`) or, for Ray's Prometheus, under Ray's name (`ray_serve_app_`)."""

from __future__ import annotations

import json
import re

from serve_app.bench.servers import ROOT
from serve_app.metrics.catalog import ENGINE_METRICS, REQUEST_METRICS, MetricSpec
from tests.inprocess import MODEL, InProcessServer, openai_client
from tests.served import metric_samples

DASHBOARD = ROOT / "deploy" / "grafana" / "serve-app.json"
NAMES = re.compile(r"(?:ray_serve_app_|serve_app:)[a-z0-9_]+")


def _exposed(spec: MetricSpec) -> set[str]:
    """The sample names a metric has in the text format."""
    if spec.kind == "counter":
        return {f"{spec.name}_total"}
    if spec.kind == "histogram":
        return {f"{spec.name}_{suffix}" for suffix in ("bucket", "sum", "count")}
    return {spec.name}


def _queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    exprs += [var["query"] for var in dashboard["templating"]["list"] if var["type"] == "query"]
    prefixes = next(var for var in dashboard["templating"]["list"] if var["name"] == "prefix")["query"].split(",")
    assert set(prefixes) == {"serve_app:", "ray_serve_app_"}
    return [expr.replace("${prefix}", prefix) for expr in exprs for prefix in prefixes]


def test_the_dashboard_names_only_metrics_the_server_exports(server: InProcessServer) -> None:
    openai_client(server.url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
    )
    exported = metric_samples(server.url).names()
    catalog = {name for spec in (*REQUEST_METRICS, *ENGINE_METRICS) for name in _exposed(spec)}
    ours = {n for n in exported if n.startswith("serve_app:") and not n.endswith("_created")}  # no creation stamps
    assert ours <= {f"serve_app:{name}" for name in catalog}
    named = {name for expr in _queries() for name in NAMES.findall(expr)}
    assert len(named) >= 2 * 14
    for name in named:
        if name.startswith("serve_app:"):
            assert name in exported, f"{name} is not on /metrics"
        else:
            assert name.removeprefix("ray_serve_app_") in catalog, f"{name} is not a metric Ray is given"
