"""The errors every layer may raise at a caller: a refused request, and an engine too busy to queue more."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses before queueing it; `param` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # it crosses to the engine's host process
        return type(self), (self.param, self.message)


class EngineOverloadedError(RuntimeError):
    """A queue of the engine is at its configured bound: retry later (HTTP 503, or 529 on Anthropic routes)."""


class CacheFullError(RuntimeError):
    """Too few free KV pages to store KV now (every page is in use by running requests): retry later."""
