"""The server's metrics and traces: one catalog of metric names (vLLM's, in the `serve_app:` namespace), exported
on each ingress's `/metrics` and mirrored into Ray's metrics (`deployments/ray_metrics.py`); optional OpenTelemetry
spans (tracing.py)."""
