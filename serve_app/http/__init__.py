"""The HTTP API: the FastAPI app and its routers, tenants, metrics, and one builder per protocol."""
