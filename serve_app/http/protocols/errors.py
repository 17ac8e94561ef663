"""ProtocolError: a client-facing failure with its HTTP status; each protocol renders it in its own shape."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from starlette.responses import JSONResponse

from serve_app.wire.refusals import RequestRefused

ErrorKind = Literal[
    "invalid_request",
    "authentication",
    "permission",
    "not_found",
    "too_large",
    "unsupported_media_type",
    "rate_limit",
    "not_ready",
    "overloaded",
    "internal",
]

STATUS = {
    "invalid_request": 400,
    "authentication": 401,
    "permission": 403,
    "not_found": 404,
    "too_large": 413,
    "unsupported_media_type": 415,
    "rate_limit": 429,
    "internal": 500,
    "not_ready": 503,
    "overloaded": 503,  # Anthropic's routes answer 529 (`anthropic.ERRORS`)
}

# Errors a client should retry after a pause (their answers carry `Retry-After`).
RETRY_LATER = frozenset({"rate_limit", "not_ready", "overloaded"})

# Engine fields that clients name otherwise: an adapter is named in the request's `model`.
_CLIENT_NAMES = {"lora": "model"}


class ProtocolError(Exception):
    """What went wrong, which field it concerns (`param`) and which HTTP status answers it."""

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.status = status or STATUS[kind]

    @classmethod
    def of(cls, refused: RequestRefused) -> ProtocolError:
        """The engine's refusal as the client sees it: the one place a refusal becomes a protocol's error (a
        field named as the client knows it)."""
        param = _CLIENT_NAMES.get(refused.param or "", refused.param)
        return cls(refused.kind, f"{param}: {refused.message}" if param else refused.message, param)


class ErrorFormat:
    """How one API writes an error: its body, and the status of each kind where the API departs from `STATUS`
    (Anthropic answers an overload with 529). Every route answers its errors through one of these."""

    def __init__(self, body: Callable[[ProtocolError], dict[str, Any]], statuses: Mapping[str, int] | None = None) -> None:
        self.body = body
        self._statuses = dict(statuses or {})

    def status(self, error: ProtocolError) -> int:
        return self._statuses.get(error.kind, error.status)

    def response(self, error: ProtocolError) -> JSONResponse:
        headers = {"Retry-After": "1"} if error.kind in RETRY_LATER else None
        return JSONResponse(self.body(error), status_code=self.status(error), headers=headers)


def invalid(message: str, param: str | None = None) -> ProtocolError:
    return ProtocolError("invalid_request", message, param)
