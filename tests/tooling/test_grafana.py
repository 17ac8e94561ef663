"""The Grafana dashboard in deploy/grafana/ parses, and every metric its queries name is one the server
exports: on an ingress's /metrics (`serve_app:`) or, for Ray's Prometheus, under Ray's name (`ray_serve_app_`).
Under `metrics_names: vllm`, every series vLLM's own Grafana dashboard queries is on /metrics, labelled as vLLM
labels them."""

from __future__ import annotations

import json
import re

from serve_app.bench.servers import ROOT
from serve_app.config import ServerConfig
from serve_app.engine.engine import InferenceEngine
from serve_app.metrics.catalog import ENGINE_METRICS, ITERATION_TOKENS, REQUEST_METRICS, MetricSpec
from tests.inprocess import MODEL, InProcessServer, engine_server, openai_client
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
    catalog = {name for spec in (*REQUEST_METRICS, *ENGINE_METRICS, ITERATION_TOKENS) for name in _exposed(spec)}
    ours = {n for n in exported if n.startswith("serve_app:") and not n.endswith("_created")}  # no creation stamps
    assert ours <= {f"serve_app:{name}" for name in catalog}
    named = {name for expr in _queries() for name in NAMES.findall(expr)}
    assert len(named) >= 2 * 14
    for name in named:
        if name.startswith("serve_app:"):
            assert name in exported, f"{name} is not on /metrics"
        else:
            assert name.removeprefix("ray_serve_app_") in catalog, f"{name} is not a metric Ray is given"


# The series vLLM's published dashboard queries (examples/online_serving/prometheus_grafana/grafana.json in
# vllm-project/vllm, commit 004f771f3a6b49597546b05c7d83686d1e121fa0: every `expr` of its panels, read on
# 2026-12-06), and the ones vLLM's docs name for autoscaling (KEDA on num_requests_waiting) and this server adds.
VLLM_DASHBOARD_SERIES = {
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:gpu_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
}
VLLM_MORE_SERIES = {
    "vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds_bucket", "vllm:iteration_tokens_total_bucket",
    "vllm:request_inference_time_seconds_sum", "vllm:cache_config_info", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
}


def test_vllm_names_serve_every_series_of_vllms_dashboard(engine: InferenceEngine) -> None:
    with engine_server(engine, ServerConfig(metrics_names="vllm")) as server:
        openai_client(server.url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
        )
        samples = metric_samples(server.url)
    exported = samples.names()
    missing = (VLLM_DASHBOARD_SERIES | VLLM_MORE_SERIES) - exported
    assert not missing, f"not on /metrics: {sorted(missing)}"
    assert not {name for name in exported if name.startswith("serve_app:")}
    assert samples.total("vllm:request_success_total", model_name=MODEL) >= 1
    labels = next(labels for name, labels, _ in samples.samples if name == "vllm:num_requests_waiting")
    assert set(labels) == {"model_name", "engine"} and labels["model_name"] == MODEL
    steps = samples.total("vllm:iteration_tokens_total_count")
    assert steps >= 3 and steps == samples.total("vllm:iteration_tokens_total_bucket", le="+Inf")
    ttft = samples.total("vllm:time_to_first_token_seconds_sum")
    assert samples.total("vllm:request_prefill_time_seconds_sum") <= ttft
