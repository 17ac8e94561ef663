"""Refusals: `RequestRefused`, the one exception an engine answers a request or a call it will not take with, and
its kinds (a bad request naming its field, an engine too busy to take more). Raised where that is found, it crosses
the engine's process and Ray as it is, and the HTTP side turns it into its protocol's error at one place
(`ProtocolError.of`)."""

from __future__ import annotations

from typing import Any, Literal

RefusalKind = Literal["invalid_request", "not_ready", "overloaded"]


class RequestRefused(Exception):
    """The engine would not take a request or a call (a Ray stream yields it as a value; it pickles as it is)."""

    kind: RefusalKind = "invalid_request"

    def __init__(self, message: str, param: str | None = None, kind: RefusalKind | None = None) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.message = message
        self.param = param
        if kind is not None:
            self.kind = kind

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # subclasses take other arguments: rebuild by fields
        return _rebuild_refusal, (type(self), self.message, self.param, self.kind)


def _rebuild_refusal(cls: type[RequestRefused], message: str, param: str | None, kind: RefusalKind) -> RequestRefused:
    refused = cls.__new__(cls)
    RequestRefused.__init__(refused, message, param, kind)
    return refused


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
