"""The server's metrics: one catalog of names (vLLM's, in the `serve_app:` namespace), exported on each
ingress's `/metrics` and mirrored into Ray's metrics."""
