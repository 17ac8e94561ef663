"""The refusals every layer may raise at a caller: a bad request, and an engine too busy to take more. Each is a
`RequestRefused` (serve_app.engine.io), so it reaches the client as its protocol's error, whoever raised it."""

from __future__ import annotations

from serve_app.engine.io import RequestRefused


class InvalidRequestError(RequestRefused, ValueError):
    """A request the engine refuses before queueing it; `param` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message, param, "invalid_request")


class EngineOverloadedError(RequestRefused):
    """A queue of the engine is at its configured bound: retry later (HTTP 503, or 529 on Anthropic routes)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, None, "overloaded")


class CacheFullError(RequestRefused):
    """Too few free KV pages to store KV now (every page is in use by running requests): retry later."""

    def __init__(self, message: str) -> None:
        super().__init__(message, None, "overloaded")
