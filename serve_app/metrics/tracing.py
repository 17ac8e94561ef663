"""Optional OpenTelemetry tracing. Off (every span a no-op) until `configure` is given an OTLP/HTTP traces
endpoint (the server's `otlp_traces_endpoint`); then each process that configured it sends its spans there.
A request's span context travels in `EncodedRequest.trace_context` (W3C `traceparent`), so the router's and
the engine's spans join the trace the ingress started."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from urllib.parse import urlsplit, urlunsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

_propagator = TraceContextTextMapPropagator()
_tracer: trace.Tracer = trace.NoOpTracer()
_endpoint: str | None = None


def configure(endpoint: str | None, service: str) -> None:
    """Send this process's spans to `endpoint` (e.g. `http://collector:4318/v1/traces`), as `service`; None: off.
    A process configures once (the ingress and the request routers in it share one exporter)."""
    global _tracer, _endpoint
    if not endpoint or _endpoint is not None:
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint), schedule_delay_millis=1000))
    _tracer, _endpoint = provider.get_tracer("serve_app"), endpoint
    logger.info("tracing: spans of %s go to %s", service, without_credentials(endpoint))


def without_credentials(url: str) -> str:
    """`url` as it may be logged: its user and password, query and fragment (where tokens ride) left out."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def tracer() -> trace.Tracer:
    return _tracer


def carrier(span: trace.Span) -> dict[str, str]:
    """`span`'s context as W3C headers (empty where tracing is off)."""
    headers: dict[str, str] = {}
    if span.get_span_context().is_valid:
        _propagator.inject(headers, trace.set_span_in_context(span))
    return headers


def parent(headers: Mapping[str, str]) -> Context | None:
    """The context `carrier` wrote, for a child span; None where there is none."""
    return _propagator.extract(dict(headers)) if headers else None
